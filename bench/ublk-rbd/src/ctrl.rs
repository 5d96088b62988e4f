//! `/dev/ublk-control`: adding, starting, stopping and deleting a device.
//! Each command is one `IORING_OP_URING_CMD` on a ring of 128-byte SQEs.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use crate::sys;

/// How long a control command may take (START_DEV waits for the queue).
const BOUND_S: u64 = 30;

/// The control device and its ring.
pub(crate) struct Control {
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    file: File,
}

impl Control {
    /// Opens `/dev/ublk-control` (`modprobe ublk_drv` makes it).
    pub(crate) fn open() -> io::Result<Control> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/ublk-control")
            .map_err(|e| io::Error::new(e.kind(), format!("/dev/ublk-control: {e}")))?;
        let ring = IoUring::builder().build(4)?;
        Ok(Control { ring, file })
    }

    /// Runs one command and waits for its result (the driver's return).
    fn cmd(
        &mut self,
        name: &str,
        op: u32,
        dev_id: u32,
        addr: u64,
        len: u16,
        data0: u64,
    ) -> io::Result<i32> {
        let sqe = opcode::UringCmd80::new(types::Fd(self.file.as_raw_fd()), op)
            .cmd(sys::ctrl_cmd(dev_id, addr, len, data0))
            .build();
        // SAFETY: io_uring's push contract: what the entry points at (the
        // command area is inline; `addr` is a struct the caller keeps alive
        // until this function returns) outlives the operation, which
        // completes before `submit_and_wait` returns below.
        unsafe { self.ring.submission().push(&sqe) }
            .map_err(|_| io::Error::other("control ring full"))?;
        // Bounded: only START_DEV waits in the driver (for the queue's
        // fetches), and it points at no memory, so a command left pending
        // past the bound can write nothing; closing the ring cancels it.
        let ts = types::Timespec::new().sec(BOUND_S);
        let args = types::SubmitArgs::new().timespec(&ts);
        match self.ring.submitter().submit_with_args(1, &args) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ETIME) => {}
            Err(e) => return Err(e),
        }
        let cqe = self.ring.completion().next().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!("ublk {name}: no answer within {BOUND_S} s"),
            )
        })?;
        let res = cqe.result();
        if res < 0 {
            let e = io::Error::from_raw_os_error(-res);
            return Err(io::Error::new(e.kind(), format!("ublk {name}: {e}")));
        }
        Ok(res)
    }

    /// `UBLK_U_CMD_ADD_DEV`: a new device with one queue of `depth` tags,
    /// requests of at most `max_io` bytes; returns its id.
    pub(crate) fn add(&mut self, depth: u16, max_io: u32) -> io::Result<u32> {
        let mut info = sys::DevInfo {
            nr_hw_queues: 1,
            queue_depth: depth,
            max_io_buf_bytes: max_io,
            dev_id: u32::MAX,
            ublksrv_pid: std::process::id() as i32,
            flags: sys::F_CMD_IOCTL_ENCODE,
            ..Default::default()
        };
        let addr = &mut info as *mut sys::DevInfo as u64;
        self.cmd("ADD_DEV", sys::CMD_ADD_DEV, u32::MAX, addr, 64, 0)?;
        Ok(info.dev_id)
    }

    /// `UBLK_U_CMD_SET_PARAMS`: the size and request limits. No volatile
    /// cache is announced: a write is answered once librbd has it in RADOS
    /// (write-through, as the fuse mapper answers), so no flush is sent.
    pub(crate) fn set_params(&mut self, id: u32, bytes: u64, max_io: u32) -> io::Result<()> {
        let mut p = sys::Params {
            len: std::mem::size_of::<sys::Params>() as u32,
            types: sys::PARAM_TYPE_BASIC,
            basic: sys::ParamBasic {
                logical_bs_shift: 9,
                physical_bs_shift: 12,
                io_opt_shift: 12,
                io_min_shift: 9,
                max_sectors: max_io >> 9,
                dev_sectors: bytes >> 9,
                ..Default::default()
            },
        };
        let addr = &mut p as *mut sys::Params as u64;
        self.cmd("SET_PARAMS", sys::CMD_SET_PARAMS, id, addr, p.len as u16, 0)
            .map(drop)
    }

    /// `UBLK_U_CMD_START_DEV`: returns once every queue has fetched all its
    /// tags; `/dev/ublkb<id>` exists then.
    pub(crate) fn start(&mut self, id: u32) -> io::Result<()> {
        let pid = u64::from(std::process::id());
        self.cmd("START_DEV", sys::CMD_START_DEV, id, 0, 0, pid)
            .map(drop)
    }

    /// `UBLK_U_CMD_STOP_DEV`: removes the block device; the queue's
    /// fetches complete with `UBLK_IO_RES_ABORT`.
    pub(crate) fn stop(&mut self, id: u32) -> io::Result<()> {
        self.cmd("STOP_DEV", sys::CMD_STOP_DEV, id, 0, 0, 0)
            .map(drop)
    }

    /// `UBLK_U_CMD_DEL_DEV`: frees the id, once the queue let go of it.
    pub(crate) fn del(&mut self, id: u32) -> io::Result<()> {
        self.cmd("DEL_DEV", sys::CMD_DEL_DEV, id, 0, 0, 0).map(drop)
    }
}
