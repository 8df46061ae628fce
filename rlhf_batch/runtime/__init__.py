"""L1, process facts: ranks (dist), devices and the allocator, hub ids, fault points for kill
tests, progress bars and stage timing. Imports only errors and core."""
