//! Synchronous I/O of 2 GiB and more in one call, against a real cluster:
//! librbd's int results and 32-bit buffer copies must not cut or misreport it.

use crate::support;

use rbdkit::rbd::{self, Image, ImageOptions, MAX_AIO_LEN};
use rbdkit::ErrorKind;
use support::ceph::TestNs;

const GIB: u64 = 1 << 30;

#[test]
fn reads_writes_and_discards_of_2_gib_and_more() {
    // The process-wide AIO count is read by tests/library/rbd_aio.rs.
    let _aio = support::aio::shared();
    let ns = TestNs::new("bigio");
    rbd::create(&ns.ioctx, "big", 5 * GIB, &ImageOptions::new()).unwrap();
    let img = Image::open(&ns.ioctx, "big").unwrap();

    // Exactly 2^31 bytes: an int result of -2^31 once overflowed the errno.
    let at = 4096u64;
    let marks = [
        0usize,
        GIB as usize - 1,
        GIB as usize,
        (2 * GIB) as usize - 1,
    ];
    {
        let mut data = vec![0u8; 2 * GIB as usize];
        for (i, m) in marks.iter().enumerate() {
            data[*m] = i as u8 + 1;
        }
        img.write(at, &data).unwrap();
    }

    // 2 GiB + 8 KiB back in one read.
    let mut back = vec![0xeeu8; (2 * GIB) as usize + 8192];
    assert_eq!(img.read(0, &mut back).unwrap(), back.len());
    for (i, m) in marks.iter().enumerate() {
        assert_eq!(back[at as usize + m], i as u8 + 1, "mark {i} at {m}");
    }
    let nonzero = back.iter().filter(|b| **b != 0).count();
    assert_eq!(nonzero, marks.len(), "only the marks are set");
    drop(back);

    // A read that runs past the end returns what there is.
    let mut tail = vec![0u8; 8192];
    assert_eq!(img.read(5 * GIB - 4096, &mut tail).unwrap(), 4096);

    // A write past the end writes nothing, however large.
    let big = vec![7u8; (GIB as usize) + 1];
    let e = img.write(4 * GIB, &big).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    drop(big);
    let mut one = [0u8; 1];
    img.read(4 * GIB, &mut one).unwrap();
    assert_eq!(one, [0]);

    // Discard and write-zeroes over more than 2 GiB.
    img.discard(0, 3 * GIB).unwrap();
    for m in marks {
        img.read(at + m as u64, &mut one).unwrap();
        assert_eq!(one, [0], "discarded at {m}");
    }
    img.write(3 * GIB, &[9u8; 16]).unwrap();
    img.write_zeroes(GIB, (2 * GIB + 4096) as usize).unwrap();
    img.read(3 * GIB, &mut one).unwrap();
    assert_eq!(one, [0], "zeroed");

    // AIO discard and write-zeroes carry no buffer: no 2 GiB bound (the
    // loop driver sends up to 4 GiB in one discard).
    img.write(3 * GIB, &[9u8; 16]).unwrap();
    futures::executor::block_on(img.aio_write_zeroes(GIB, (2 * GIB + 8192) as usize))
        .unwrap_or_else(|e| panic!("aio_write_zeroes of 2 GiB + 8 KiB: {e}"));
    img.read(3 * GIB, &mut one).unwrap();
    assert_eq!(one, [0], "zeroed by AIO");
    img.write(4 * GIB + 4096, &[8u8; 16]).unwrap();
    futures::executor::block_on(img.aio_discard(0, 5 * GIB))
        .unwrap_or_else(|e| panic!("aio_discard of 5 GiB: {e}"));
    img.read(4 * GIB + 4096, &mut one).unwrap();
    assert_eq!(one, [0], "discarded by AIO");

    // AIO requests above the bound are refused, not cut.
    let e = futures::executor::block_on(img.aio_read(0, MAX_AIO_LEN as usize + 1)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    img.close().unwrap();
    rbd::remove(&ns.ioctx, "big").unwrap();
}
