//! The ublk driver's user API (`include/uapi/linux/ublk_cmd.h`), the part
//! this server uses: ioctl-encoded commands, which 6.12 takes whatever
//! `CONFIG_BLKDEV_UBLK_LEGACY_OPCODES` says.

use std::mem::size_of;

/// `struct ublksrv_ctrl_cmd`: a control command, carried in the SQE's
/// command area (80 bytes with `IORING_SETUP_SQE128`).
pub(crate) const CTRL_CMD_LEN: usize = 32;
/// `struct ublksrv_io_cmd`: an I/O command, in a 64-byte SQE's 16 bytes.
pub(crate) const IO_CMD_LEN: usize = 16;

const fn iowr(nr: u32, size: usize) -> u32 {
    // _IOWR('u', nr, size): direction read|write (3) in bits 30-31.
    (3 << 30) | ((size as u32) << 16) | ((b'u' as u32) << 8) | nr
}

/// `UBLK_U_CMD_ADD_DEV`.
pub(crate) const CMD_ADD_DEV: u32 = iowr(0x04, CTRL_CMD_LEN);
/// `UBLK_U_CMD_DEL_DEV`.
pub(crate) const CMD_DEL_DEV: u32 = iowr(0x05, CTRL_CMD_LEN);
/// `UBLK_U_CMD_START_DEV`.
pub(crate) const CMD_START_DEV: u32 = iowr(0x06, CTRL_CMD_LEN);
/// `UBLK_U_CMD_STOP_DEV`.
pub(crate) const CMD_STOP_DEV: u32 = iowr(0x07, CTRL_CMD_LEN);
/// `UBLK_U_CMD_SET_PARAMS`.
pub(crate) const CMD_SET_PARAMS: u32 = iowr(0x08, CTRL_CMD_LEN);
/// `UBLK_U_IO_FETCH_REQ`.
pub(crate) const IO_FETCH_REQ: u32 = iowr(0x20, IO_CMD_LEN);
/// `UBLK_U_IO_COMMIT_AND_FETCH_REQ`.
pub(crate) const IO_COMMIT_AND_FETCH_REQ: u32 = iowr(0x21, IO_CMD_LEN);

/// `UBLK_F_CMD_IOCTL_ENCODE`.
pub(crate) const F_CMD_IOCTL_ENCODE: u64 = 1 << 6;
/// `UBLK_PARAM_TYPE_BASIC`.
pub(crate) const PARAM_TYPE_BASIC: u32 = 1;
/// `UBLK_IO_OP_*`.
pub(crate) const OP_READ: u8 = 0;
/// Write.
pub(crate) const OP_WRITE: u8 = 1;
/// Flush.
pub(crate) const OP_FLUSH: u8 = 2;
/// Discard.
pub(crate) const OP_DISCARD: u8 = 3;
/// Write zeroes.
pub(crate) const OP_WRITE_ZEROES: u8 = 5;

/// `struct ublksrv_ctrl_dev_info`.
#[repr(C)]
#[derive(Default)]
pub(crate) struct DevInfo {
    pub(crate) nr_hw_queues: u16,
    pub(crate) queue_depth: u16,
    pub(crate) state: u16,
    pub(crate) pad0: u16,
    pub(crate) max_io_buf_bytes: u32,
    pub(crate) dev_id: u32,
    pub(crate) ublksrv_pid: i32,
    pub(crate) pad1: u32,
    pub(crate) flags: u64,
    pub(crate) ublksrv_flags: u64,
    pub(crate) owner_uid: u32,
    pub(crate) owner_gid: u32,
    pub(crate) reserved1: u64,
    pub(crate) reserved2: u64,
}

/// `struct ublk_param_basic`.
#[repr(C)]
#[derive(Default)]
pub(crate) struct ParamBasic {
    pub(crate) attrs: u32,
    pub(crate) logical_bs_shift: u8,
    pub(crate) physical_bs_shift: u8,
    pub(crate) io_opt_shift: u8,
    pub(crate) io_min_shift: u8,
    pub(crate) max_sectors: u32,
    pub(crate) chunk_sectors: u32,
    pub(crate) dev_sectors: u64,
    pub(crate) virt_boundary_mask: u64,
}

/// The head of `struct ublk_params` with only the basic parameters: the
/// driver copies `len` bytes, so the later parameter types can be left out.
#[repr(C)]
#[derive(Default)]
pub(crate) struct Params {
    pub(crate) len: u32,
    pub(crate) types: u32,
    pub(crate) basic: ParamBasic,
}

/// `struct ublksrv_io_desc`: one request, as the driver lays it out in the
/// queue's shared descriptor array (indexed by tag).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct IoDesc {
    pub(crate) op_flags: u32,
    pub(crate) nr_sectors: u32,
    pub(crate) start_sector: u64,
    pub(crate) addr: u64,
}

const _: () = assert!(size_of::<DevInfo>() == 64);
const _: () = assert!(size_of::<ParamBasic>() == 32);
const _: () = assert!(size_of::<Params>() == 40);
const _: () = assert!(size_of::<IoDesc>() == 24);

/// A control command's bytes (`struct ublksrv_ctrl_cmd`; queue_id -1).
pub(crate) fn ctrl_cmd(dev_id: u32, addr: u64, len: u16, data0: u64) -> [u8; 80] {
    let mut b = [0u8; 80];
    b[0..4].copy_from_slice(&dev_id.to_ne_bytes());
    b[4..6].copy_from_slice(&u16::MAX.to_ne_bytes());
    b[6..8].copy_from_slice(&len.to_ne_bytes());
    b[8..16].copy_from_slice(&addr.to_ne_bytes());
    b[16..24].copy_from_slice(&data0.to_ne_bytes());
    b
}

/// An I/O command's bytes (`struct ublksrv_io_cmd`).
pub(crate) fn io_cmd(q_id: u16, tag: u16, result: i32, addr: u64) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..2].copy_from_slice(&q_id.to_ne_bytes());
    b[2..4].copy_from_slice(&tag.to_ne_bytes());
    b[4..8].copy_from_slice(&result.to_ne_bytes());
    b[8..16].copy_from_slice(&addr.to_ne_bytes());
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_encoded_as_the_kernel_header_defines_them() {
        // UBLK_U_CMD_ADD_DEV and UBLK_U_IO_FETCH_REQ as 6.12's header
        // expands them (_IOWR('u', 0x04, 32 bytes), _IOWR('u', 0x20, 16)).
        assert_eq!(CMD_ADD_DEV, 0xc020_7504);
        assert_eq!(IO_FETCH_REQ, 0xc010_7520);
        assert_eq!(IO_COMMIT_AND_FETCH_REQ, 0xc010_7521);
    }

    #[test]
    fn command_bytes_follow_the_structs_layout() {
        let c = ctrl_cmd(7, 0x1122, 64, 99);
        assert_eq!(&c[0..4], &7u32.to_ne_bytes());
        assert_eq!(&c[4..6], &[0xff, 0xff]);
        assert_eq!(&c[6..8], &64u16.to_ne_bytes());
        assert_eq!(&c[16..24], &99u64.to_ne_bytes());
        let i = io_cmd(0, 5, -5, 0xabc);
        assert_eq!(&i[2..4], &5u16.to_ne_bytes());
        assert_eq!(&i[4..8], &(-5i32).to_ne_bytes());
        assert_eq!(&i[8..16], &0xabcu64.to_ne_bytes());
    }
}
