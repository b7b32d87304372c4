"""CLI subcommands. Each ``<name>_args`` module declares one command's flags and help and hands
the parsed arguments to the command (imported only then); the command module (``check_pod``,
``explain``, the ``demo`` package, ...; ``enforce`` and ``agent`` run from ``gpuguard.app``) parses
nothing, wires adapters and renders one contract. ``options`` holds what the parsers share."""
