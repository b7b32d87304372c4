"""CLI subcommands: each parses nothing, wires adapters and renders one contract."""
