//! The AIO futures on tokio, against a real cluster: the `ImageIo`
//! AsyncRead/AsyncWrite/AsyncSeek adapter, and many tokio tasks sharing one
//! image handle (some of them aborted mid-request). Needs the `service`
//! feature.

use crate::support;

use std::io::SeekFrom;
use std::sync::Arc;

use rbdkit::rbd::{self, Image, ImageIo, ImageOptions};
use support::ceph::TestNs;
use support::data::pattern;
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};

const MIB: u64 = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_io_copies_in_reads_back_and_seeks() {
    // The process-wide AIO count is read by tests/library/rbd_aio.rs.
    let _aio = support::aio::shared();
    let ns = TestNs::new("aio-tokio-io");
    rbd::create(&ns.ioctx, "img", 8 * MIB, &ImageOptions::new()).unwrap();
    let img = Image::open_async(&ns.ioctx, "img").await.unwrap();
    let mut io = ImageIo::new(img).with_queue_depth(8);

    // Copy 5 MiB and a bit in (tokio::io::copy writes in small pieces, so
    // many writes are in flight), then read it back.
    let data = pattern(1, 5 * MIB as usize + 123);
    let n = tokio::io::copy(&mut &data[..], &mut io).await.unwrap();
    assert_eq!(n, data.len() as u64);
    io.flush().await.unwrap();
    assert_eq!(io.position(), data.len() as u64);
    assert_eq!(io.seek(SeekFrom::Start(0)).await.unwrap(), 0);
    let mut back = vec![0u8; data.len()];
    io.read_exact(&mut back).await.unwrap();
    assert!(back == data, "read_exact gives back what copy wrote");
    let mut sync_back = vec![0u8; 4096];
    io.image().read_exact(MIB, &mut sync_back).unwrap();
    assert_eq!(sync_back, data[MIB as usize..MIB as usize + 4096]);

    // Copy out through `take`.
    io.seek(SeekFrom::Start(1000)).await.unwrap();
    let mut out = Vec::new();
    tokio::io::copy(&mut (&mut io).take(300_000), &mut out)
        .await
        .unwrap();
    assert!(out == data[1000..301_000]);

    // Seeks relative to the position and to the end.
    io.seek(SeekFrom::Start(100)).await.unwrap();
    assert_eq!(io.seek(SeekFrom::Current(-50)).await.unwrap(), 50);
    let mut ten = [0u8; 10];
    io.read_exact(&mut ten).await.unwrap();
    assert_eq!(ten, data[50..60]);
    let e = io.seek(SeekFrom::Current(-1000)).await.unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    assert_eq!(io.seek(SeekFrom::End(-10)).await.unwrap(), 8 * MIB - 10);
    let mut tail = Vec::new();
    io.read_to_end(&mut tail).await.unwrap();
    assert_eq!(tail, vec![0u8; 10], "never written: zeroes, then the end");

    // Writes do not grow the image.
    io.seek(SeekFrom::End(-4)).await.unwrap();
    let e = io.write_all(&[1u8; 10]).await.unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::WriteZero);
    io.shutdown().await.unwrap();
    let mut end = [0u8; 4];
    io.image().read_exact(8 * MIB - 4, &mut end).unwrap();
    assert_eq!(end, [1u8; 4]);

    // Overwrite in the middle, then read across the boundary.
    io.seek(SeekFrom::Start(2 * MIB - 2)).await.unwrap();
    io.write_all(b"abcd").await.unwrap();
    io.seek(SeekFrom::Start(2 * MIB - 4)).await.unwrap();
    let mut mid = [0u8; 8];
    io.read_exact(&mut mid).await.unwrap();
    let m = (2 * MIB) as usize;
    assert_eq!(&mid[..2], &data[m - 4..m - 2]);
    assert_eq!(&mid[2..6], b"abcd");
    assert_eq!(&mid[6..], &data[m + 2..m + 4]);

    let img = Arc::try_unwrap(io.into_inner()).expect("the only reference");
    img.close_async().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokio_tasks_share_one_image_handle() {
    // The process-wide AIO count is read by tests/library/rbd_aio.rs.
    let _aio = support::aio::shared();
    let ns = TestNs::new("aio-tokio-share");
    rbd::create(&ns.ioctx, "img", 64 * MIB, &ImageOptions::new()).unwrap();
    let img = Arc::new(Image::open_async(&ns.ioctx, "img").await.unwrap());
    const TASKS: u64 = 32;
    const PER_TASK: u64 = 8;
    const BLOCK: usize = 64 << 10;
    let offset = |t: u64, k: u64| (t * PER_TASK + k) * BLOCK as u64;

    let mut set = tokio::task::JoinSet::new();
    for t in 0..TASKS {
        let img = Arc::clone(&img);
        set.spawn(async move {
            // Half of each task's writes are in flight together.
            let (a, b): (Vec<u64>, Vec<u64>) = (0..PER_TASK).partition(|k| k % 2 == 0);
            for half in [a, b] {
                let writes: Vec<_> = half
                    .iter()
                    .map(|&k| img.aio_write(offset(t, k), pattern(t * 100 + k, BLOCK)))
                    .collect();
                for w in writes {
                    w.await?;
                }
            }
            for k in 0..PER_TASK {
                let back = img.aio_read(offset(t, k), BLOCK).await?;
                assert!(back == pattern(t * 100 + k, BLOCK), "task {t} block {k}");
            }
            Ok::<_, rbdkit::Error>(())
        });
    }
    while let Some(r) = set.join_next().await {
        r.unwrap().unwrap();
    }

    // Tasks aborted while their requests are in flight: the requests finish
    // on their own, nothing crashes, the handle stays usable.
    let mut aborted = tokio::task::JoinSet::new();
    for t in 0..TASKS {
        let img = Arc::clone(&img);
        aborted.spawn(async move {
            let _ = img.aio_write(48 * MIB + t * 4096, vec![0xeeu8; 4096]).await;
            std::future::pending::<()>().await;
        });
    }
    tokio::task::yield_now().await;
    aborted.abort_all();
    while aborted.join_next().await.is_some() {}
    img.aio_flush().await.unwrap();

    let img = Arc::try_unwrap(img).expect("all tasks are done");
    // Everything written by the first tasks is there after an async close.
    img.close_async().await.unwrap();
    let ro = Image::open_read_only_async(&ns.ioctx, "img").await.unwrap();
    for t in [0, TASKS / 2, TASKS - 1] {
        let back = ro.aio_read(offset(t, 3), BLOCK).await.unwrap();
        assert!(back == pattern(t * 100 + 3, BLOCK));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_io_uses_the_cached_size() {
    // The process-wide AIO count is read by tests/library/rbd_aio.rs.
    let _aio = support::aio::shared();
    let ns = TestNs::new("aio-tokio-size");
    rbd::create(&ns.ioctx, "img", 4 * MIB, &ImageOptions::new()).unwrap();
    let img = Arc::new(Image::open_async(&ns.ioctx, "img").await.unwrap());
    let mut io = ImageIo::new(Arc::clone(&img));
    let data = pattern(3, 2 * MIB as usize);
    for chunk in data.chunks(16 * 1024) {
        io.write_all(chunk).await.unwrap();
    }
    io.flush().await.unwrap();
    io.seek(SeekFrom::Start(0)).await.unwrap();
    let mut back = vec![0u8; data.len()];
    io.read_exact(&mut back).await.unwrap();
    assert!(back == data);
    // 128 writes and the reads: the size was looked up once (async open
    // leaves it unknown), not per call.
    assert_eq!(img.io_size_lookups(), 1);
}
