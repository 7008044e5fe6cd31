"""The FUSE kernel protocol (``include/uapi/linux/fuse.h``, 7.41, and 7.45's
COPY_FILE_RANGE_64, which the kernel sends whatever minor INIT agreed): opcodes,
flags and the struct layouts the kernel engine reads and writes, each named
once, after the header.  Little-endian, as the kernel writes them on every
architecture cowfs runs on."""

from __future__ import annotations

import struct

KERNEL_VERSION = 7
KERNEL_MINOR = 41  # what this engine speaks (the kernel's, if lower)
ROOT_ID = 1
MIN_READ_BUFFER = 8192

# -- opcodes --------------------------------------------------------------------------

LOOKUP, FORGET, GETATTR, SETATTR, READLINK, SYMLINK = 1, 2, 3, 4, 5, 6
MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK, OPEN, READ, WRITE, STATFS = (
    8,
    9,
    10,
    11,
    12,
    13,
    14,
    15,
    16,
    17,
)
RELEASE, FSYNC, SETXATTR, GETXATTR, LISTXATTR, REMOVEXATTR, FLUSH, INIT = (
    18,
    20,
    21,
    22,
    23,
    24,
    25,
    26,
)
OPENDIR, READDIR, RELEASEDIR, FSYNCDIR, GETLK, SETLK, SETLKW, ACCESS, CREATE = (
    27,
    28,
    29,
    30,
    31,
    32,
    33,
    34,
    35,
)
INTERRUPT, BMAP, DESTROY, IOCTL, POLL, NOTIFY_REPLY, BATCH_FORGET, FALLOCATE = (
    36,
    37,
    38,
    39,
    40,
    41,
    42,
    43,
)
READDIRPLUS, RENAME2, LSEEK, COPY_FILE_RANGE, SETUPMAPPING, REMOVEMAPPING = (44, 45, 46, 47, 48, 49)
SYNCFS, TMPFILE, STATX = 50, 51, 52
COPY_FILE_RANGE_64 = 53  # (7.45, Linux 6.18)

OPCODE_NAMES = {
    number: name.lower()
    for name, number in (
        ("LOOKUP", LOOKUP),
        ("FORGET", FORGET),
        ("GETATTR", GETATTR),
        ("SETATTR", SETATTR),
        ("READLINK", READLINK),
        ("SYMLINK", SYMLINK),
        ("MKNOD", MKNOD),
        ("MKDIR", MKDIR),
        ("UNLINK", UNLINK),
        ("RMDIR", RMDIR),
        ("RENAME", RENAME),
        ("LINK", LINK),
        ("OPEN", OPEN),
        ("READ", READ),
        ("WRITE", WRITE),
        ("STATFS", STATFS),
        ("RELEASE", RELEASE),
        ("FSYNC", FSYNC),
        ("SETXATTR", SETXATTR),
        ("GETXATTR", GETXATTR),
        ("LISTXATTR", LISTXATTR),
        ("REMOVEXATTR", REMOVEXATTR),
        ("FLUSH", FLUSH),
        ("INIT", INIT),
        ("OPENDIR", OPENDIR),
        ("READDIR", READDIR),
        ("RELEASEDIR", RELEASEDIR),
        ("FSYNCDIR", FSYNCDIR),
        ("GETLK", GETLK),
        ("SETLK", SETLK),
        ("SETLKW", SETLKW),
        ("ACCESS", ACCESS),
        ("CREATE", CREATE),
        ("INTERRUPT", INTERRUPT),
        ("BMAP", BMAP),
        ("DESTROY", DESTROY),
        ("IOCTL", IOCTL),
        ("POLL", POLL),
        ("BATCH_FORGET", BATCH_FORGET),
        ("FALLOCATE", FALLOCATE),
        ("READDIRPLUS", READDIRPLUS),
        ("RENAME2", RENAME2),
        ("LSEEK", LSEEK),
        ("COPY_FILE_RANGE", COPY_FILE_RANGE),
        ("SYNCFS", SYNCFS),
        ("TMPFILE", TMPFILE),
        ("STATX", STATX),
        ("COPY_FILE_RANGE_64", COPY_FILE_RANGE_64),
    )
}

# -- notifications (the error field of an unsolicited message) -----------------------

NOTIFY_INVAL_INODE, NOTIFY_INVAL_ENTRY, NOTIFY_DELETE = 2, 3, 6

# -- INIT flags (flags2 holds bits 32..63, shifted down) -----------------------------

ASYNC_READ = 1 << 0
POSIX_LOCKS = 1 << 1
ATOMIC_O_TRUNC = 1 << 3
EXPORT_SUPPORT = 1 << 4
BIG_WRITES = 1 << 5
DONT_MASK = 1 << 6
AUTO_INVAL_DATA = 1 << 12
DO_READDIRPLUS = 1 << 13
READDIRPLUS_AUTO = 1 << 14
WRITEBACK_CACHE = 1 << 16
PARALLEL_DIROPS = 1 << 18
POSIX_ACL = 1 << 20
MAX_PAGES = 1 << 22
CACHE_SYMLINKS = 1 << 23
EXPLICIT_INVAL_DATA = 1 << 25
HANDLE_KILLPRIV_V2 = 1 << 28
SETXATTR_EXT = 1 << 29
INIT_EXT = 1 << 30
PASSTHROUGH = 1 << 37
NO_EXPORT_SUPPORT = 1 << 38

# -- other flags ---------------------------------------------------------------------

FATTR_MODE, FATTR_UID, FATTR_GID, FATTR_SIZE = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FATTR_ATIME, FATTR_MTIME, FATTR_FH = 1 << 4, 1 << 5, 1 << 6
FATTR_ATIME_NOW, FATTR_MTIME_NOW, FATTR_LOCKOWNER = 1 << 7, 1 << 8, 1 << 9
FATTR_CTIME, FATTR_KILL_SUIDGID = 1 << 10, 1 << 11

FOPEN_DIRECT_IO, FOPEN_KEEP_CACHE, FOPEN_NONSEEKABLE = 1 << 0, 1 << 1, 1 << 2
FOPEN_CACHE_DIR, FOPEN_NOFLUSH, FOPEN_PASSTHROUGH = 1 << 3, 1 << 5, 1 << 7

OPEN_KILL_SUIDGID = 1 << 0  # fuse_open_in / fuse_create_in .open_flags
WRITE_KILL_SUIDGID = 1 << 2  # fuse_write_in .write_flags
GETATTR_FH = 1 << 0
FSYNC_FDATASYNC = 1 << 0
UNIQUE_RESEND = 1 << 63

# -- structs -------------------------------------------------------------------------

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid extlen pad
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr: 88
ENTRY_OUT = struct.Struct("<QQQQII")  # + fuse_attr: 128
ATTR_OUT = struct.Struct("<QII")  # + fuse_attr: 104
OPEN_OUT = struct.Struct("<QIi")  # fh open_flags backing_id
INIT_IN = struct.Struct("<IIIII")  # major minor max_readahead flags flags2
INIT_OUT = struct.Struct("<IIIIHHIIHHIIH22x")  # ... flags2 max_stack_depth request_timeout
FORGET_IN = struct.Struct("<Q")
BATCH_FORGET_IN = struct.Struct("<II")
FORGET_ONE = struct.Struct("<QQ")
GETATTR_IN = struct.Struct("<IIQ")
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")  # valid pad fh size lock_owner a m c times...
MKNOD_IN = struct.Struct("<IIII")  # mode rdev umask pad
MKDIR_IN = struct.Struct("<II")  # mode umask
RENAME_IN = struct.Struct("<Q")
RENAME2_IN = struct.Struct("<QII")
LINK_IN = struct.Struct("<Q")
OPEN_IN = struct.Struct("<II")  # flags open_flags
CREATE_IN = struct.Struct("<IIII")  # flags mode umask open_flags
RELEASE_IN = struct.Struct("<QIIQ")
READ_IN = struct.Struct("<QQIIQII")  # fh offset size read_flags lock_owner flags pad
WRITE_IN = struct.Struct("<QQIIQII")  # fh offset size write_flags lock_owner flags pad
WRITE_OUT = struct.Struct("<II")
KSTATFS = struct.Struct("<QQQQQIIII24x")  # 80
FSYNC_IN = struct.Struct("<QII")
SETXATTR_IN = struct.Struct("<II")  # size flags (8: without SETXATTR_EXT)
GETXATTR_IN = struct.Struct("<II")
GETXATTR_OUT = struct.Struct("<II")
ACCESS_IN = struct.Struct("<II")
INTERRUPT_IN = struct.Struct("<Q")
FALLOCATE_IN = struct.Struct("<QQQII")
LSEEK_IN = struct.Struct("<QQII")
LSEEK_OUT = struct.Struct("<Q")
COPY_FILE_RANGE_IN = struct.Struct("<QQQQQQQ")  # fh_in off_in nodeid_out fh_out off_out len flags
COPY_FILE_RANGE_OUT = struct.Struct("<Q")  # bytes_copied (COPY_FILE_RANGE answers in WRITE_OUT)
DIRENT = struct.Struct("<QQII")  # ino off namelen type (+ name, 8-aligned)
NOTIFY_INVAL_INODE_OUT = struct.Struct("<Qqq")
NOTIFY_INVAL_ENTRY_OUT = struct.Struct("<QII")
BACKING_MAP = struct.Struct("<iIQ")  # fd flags padding

DEV_IOC_BACKING_OPEN = 0x4010E501  # _IOW(229, 1, struct fuse_backing_map)
DEV_IOC_BACKING_CLOSE = 0x4004E502  # _IOW(229, 2, uint32_t)

ENTRY_SIZE = ENTRY_OUT.size + ATTR.size  # 128
