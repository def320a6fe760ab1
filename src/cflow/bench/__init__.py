"""Benchmarks behind `cflow bench`: one module per benchmark (kernels, decode), each with
add_arguments(parser) and main(args) -> int. Speed is measured here, never asserted in tests."""
