"""What the layers above stand on: fd-relative system calls that never
follow a planted symlink (``backing``), mounts and the mount table,
which stores are trusted, deadlines, permission checks for a requester,
and the progress board."""
