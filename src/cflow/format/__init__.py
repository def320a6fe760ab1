"""The .cflow tile-native weight format (docs/FORMAT.md)."""
