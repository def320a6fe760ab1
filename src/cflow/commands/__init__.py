"""CLI verbs: one module each (HELP, add_arguments(parser), main(args) -> int)."""
