"""The options that ask any command for its help text: one light module, since the console script
(``studio.cli.entry``) reads them before typer is imported and the CLI's commands (``studio.cli.common``)
declare them, and neither may import the other."""

HELP_OPTIONS = ("-h", "--help")
