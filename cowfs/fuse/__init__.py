"""The FUSE side: the filesystem's operations over an inode table
(``ops``, ``inodes``), knowing no FUSE library, and the engines that serve
them -- the kernel protocol spoken on /dev/fuse (``kernel_engine``, with
its ABI in ``fuse_abi``) and pyfuse3 -- and the read-only views of the past."""
