"""The ``jpfs`` command: one module per subcommand group (see ``main.GROUPS``)."""
