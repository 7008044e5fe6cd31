"""The layer store: the record schema, LMDB and the blob directories
(``store``), the journal's readings, the grave's content hashes, data
digests and zero runs, and ``check``."""
