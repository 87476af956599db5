"""One module per page: handlers (plain functions) -> layout -> event wiring."""
