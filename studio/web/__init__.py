"""The studio page's files (HTML, CSS, JavaScript modules), served by ``studio.http.gui.page``."""
