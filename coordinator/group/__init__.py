"""GroupCoordinator and the parts it is built from: setup, registry, object calls, errors, broadcasters."""
