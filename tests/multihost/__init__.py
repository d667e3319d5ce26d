"""The mesh across hosts made on one machine (`make test-multihost`)."""
