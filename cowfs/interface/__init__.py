"""The interfaces: every operation declared once (``operations``, the
command classes on ``command``, derived by ``commands``), the ``cowfs``
command (``cli``), the one client of the control channel (``client``; the
Python API's ``Workspace`` is one), the MCP server, the agent CLI hooks and
``doctor``.  Nothing here changes a workspace tree: it asks the daemon."""
