"""The Plan IR and its renderings: immutable records, plan text, schedule grids, Chrome traces."""
