"""Graph-to-graph transforms, one per file; see pipeline.py for the order."""
