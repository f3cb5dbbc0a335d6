"""Chat history: conversations and their messages in a SQLite database in the studio home, searchable, exportable.

- ``database``: the file, its schema version and migrations, and the refusal of one the studio cannot use;
- ``store``: the queries, each on one thread's connection; ``service``: the writer and reader threads;
- ``recorder``: a ``/api/chat`` turn stored as it streams; ``transfer``: export and import;
- ``api``: the ``/api/conversations`` routes.
"""
