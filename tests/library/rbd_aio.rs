//! Async (AIO) image I/O against a real cluster, runtime-agnostic (driven by
//! `futures::executor`): every operation with its data checked, async open
//! and close, many requests in flight on one handle from several threads,
//! thousands of dropped in-flight futures (no use-after-free, no leak), and
//! images dropped or closed with requests in flight.

use crate::support;

use std::future::Future;
use std::pin::Pin;
use std::sync::{mpsc, Arc};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::executor::block_on;
use futures::future::join_all;
use futures::task::noop_waker;
use rbdkit::rbd::{self, aio_live_requests, Image, ImageOptions};
use rbdkit::ErrorKind;
use support::aio::{exclusive, shared};
use support::ceph::TestNs;
use support::data::pattern;

const MIB: u64 = 1 << 20;

fn new_image(ns: &TestNs, name: &str, size: u64) -> Image {
    rbd::create(&ns.ioctx, name, size, &ImageOptions::new()).unwrap();
    Image::open(&ns.ioctx, name).unwrap()
}

fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    let waker = noop_waker();
    let mut cx = Context::from_waker(&waker);
    Pin::new(f).poll(&mut cx)
}

fn wait_for_live_requests(n: usize) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while aio_live_requests() != n {
        assert!(
            Instant::now() < deadline,
            "{} AIO requests still hold memory after 120 s, expected {n}",
            aio_live_requests()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn wait_for_no_live_requests() {
    wait_for_live_requests(0);
}

fn vm_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status")
}

#[test]
fn every_aio_op_with_its_data_checked() {
    let _g = shared();
    let ns = TestNs::new("aio-ops");
    let img = new_image(&ns, "img", 16 * MIB);
    block_on(async {
        // write / read / read_into
        let data = pattern(1, 64 << 10);
        img.aio_write(4096, data.clone()).await.unwrap();
        assert_eq!(img.aio_read(4096, data.len()).await.unwrap(), data);
        let mut sync_back = vec![0u8; data.len()];
        img.read_exact(4096, &mut sync_back).unwrap();
        assert_eq!(sync_back, data, "the sync path sees the AIO write");
        let reused = img.aio_read_into(4096 + 10, vec![0xff; 100]).await.unwrap();
        assert_eq!(reused, data[10..110]);
        img.aio_write(0, &b"borrowed slices are copied"[..])
            .await
            .unwrap();
        assert_eq!(
            img.aio_read(0, 8).await.unwrap(),
            b"borrowed",
            "impl Into<Vec<u8>>"
        );

        // writev / readv
        let parts = vec![pattern(2, 1000), pattern(3, 5000), pattern(4, 3)];
        let whole = parts.concat();
        img.aio_writev(MIB, parts.clone()).await.unwrap();
        assert_eq!(img.aio_read(MIB, whole.len()).await.unwrap(), whole);
        let got = img
            .aio_readv(MIB, vec![vec![0; 3], vec![0; 6000], vec![0; 2]])
            .await
            .unwrap();
        assert_eq!(
            got.iter().map(Vec::len).collect::<Vec<_>>(),
            vec![3, 6000, 2]
        );
        let mut expected = whole.clone();
        expected.extend_from_slice(&[0, 0]); // never written
        assert_eq!(got.concat(), expected);

        // discard reads back as zeroes (librbd may skip partial-object
        // discards, so discard a whole object)
        img.aio_write(8 * MIB + 4096, vec![7u8; 8192])
            .await
            .unwrap();
        img.aio_discard(8 * MIB, 4 * MIB).await.unwrap();
        assert!(img
            .aio_read(8 * MIB + 4096, 8192)
            .await
            .unwrap()
            .iter()
            .all(|b| *b == 0));

        // write_zeroes touches only its range
        img.aio_write(3 * MIB, vec![9u8; 4096]).await.unwrap();
        img.aio_write_zeroes(3 * MIB + 1024, 2048).await.unwrap();
        let z = img.aio_read(3 * MIB, 4096).await.unwrap();
        assert!(z[..1024].iter().all(|b| *b == 9));
        assert!(z[1024..3072].iter().all(|b| *b == 0));
        assert!(z[3072..].iter().all(|b| *b == 9));

        img.aio_flush().await.unwrap();

        // A read that runs past the end is short.
        let tail = img.aio_read(16 * MIB - 10, 100).await.unwrap();
        assert_eq!(tail.len(), 10);
        let tail = img
            .aio_readv(16 * MIB - 10, vec![vec![0; 4], vec![0; 100], vec![0; 5]])
            .await
            .unwrap();
        assert_eq!(tail.iter().map(Vec::len).collect::<Vec<_>>(), vec![4, 6, 0]);

        // Refused before any call: overflow, no buffers.
        let e = img.aio_read(u64::MAX, 10).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        let e = img.aio_readv(0, vec![]).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        let e = img.aio_writev(0, vec![vec![1]; 1025]).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");

        // Compare-and-write: written on a match, mismatch offset otherwise.
        #[cfg(librbd_supports_compare_and_write)]
        {
            img.aio_write(0, vec![0u8; 512]).await.unwrap();
            let r = img
                .aio_compare_and_write(0, vec![0; 512], vec![9; 512])
                .await
                .unwrap();
            assert_eq!(r, None);
            let r = img
                .aio_compare_and_write(0, vec![0; 512], vec![8; 512])
                .await
                .unwrap();
            assert_eq!(r, Some(0));
            let mut expected = vec![9u8; 512];
            expected[100] = 1;
            let r = img
                .aio_compare_and_write(0, expected, vec![7; 512])
                .await
                .unwrap();
            assert_eq!(r, Some(100));
            assert!(img.aio_read(0, 512).await.unwrap().iter().all(|b| *b == 9));
            let e = img
                .aio_compare_and_write(0, vec![0; 10], vec![0; 11])
                .await
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        }

        // An error reported through the completion.
        let ro = Image::open_read_only(&ns.ioctx, "img").unwrap();
        let e = ro.aio_write(0, vec![1u8; 10]).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ReadOnly, "{e}");
        assert_eq!(e.op(), "rbd_aio_write");
        assert!(e.object().ends_with("/img"), "{e}");
        assert_eq!(ro.aio_read(4096, 16).await.unwrap(), data[..16]);
    });
}

#[test]
fn async_open_and_close() {
    let _g = shared();
    let ns = TestNs::new("aio-open");
    rbd::create(&ns.ioctx, "img", 4 * MIB, &ImageOptions::new()).unwrap();
    block_on(async {
        let img = Image::open_async(&ns.ioctx, "img").await.unwrap();
        assert_eq!(img.name(), "img");
        assert!(!img.is_read_only());
        assert_eq!(img.size().unwrap(), 4 * MIB);
        img.aio_write(0, b"hello".to_vec()).await.unwrap();
        img.close_async().await.unwrap();

        let ro = Image::open_read_only_async(&ns.ioctx, "img").await.unwrap();
        assert!(ro.is_read_only());
        assert_eq!(ro.aio_read(0, 5).await.unwrap(), b"hello");
        let e = ro.aio_write(0, b"x".to_vec()).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ReadOnly, "{e}");
        ro.close_async().await.unwrap();

        let e = Image::open_async(&ns.ioctx, "missing").await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
        assert_eq!(e.op(), "rbd_aio_open");
        let e = Image::open_read_only_async(&ns.ioctx, "missing")
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
        let e = Image::open_async(&ns.ioctx, "nul\0name").await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    });
    // Closed for real: no watcher keeps the image from being removed.
    rbd::remove(&ns.ioctx, "img").unwrap();
}

#[test]
fn dropped_open_and_close_futures_leak_no_handle() {
    let _g = exclusive();
    let ns = TestNs::new("aio-open-drop");
    rbd::create(&ns.ioctx, "img", 4 * MIB, &ImageOptions::new()).unwrap();
    for _ in 0..10 {
        drop(Image::open_async(&ns.ioctx, "img"));
        let mut f = Image::open_read_only_async(&ns.ioctx, "img");
        let _ = poll_once(&mut f);
        drop(f);
    }
    let img = Image::open(&ns.ioctx, "img").unwrap();
    // A write dropped in flight, then a close dropped in flight.
    drop(img.aio_write(0, vec![5u8; 4096]));
    drop(img.close_async());
    wait_for_no_live_requests();
    // The background threads close every image they were left with; if one
    // were leaked its watch would keep the image busy forever.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match rbd::remove(&ns.ioctx, "img") {
            Ok(()) => break,
            Err(e) if e.kind() == ErrorKind::Busy && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("image still held open: {e}"),
        }
    }
}

#[test]
fn many_requests_in_flight_on_one_handle_from_threads_and_tasks() {
    let _g = shared();
    let ns = TestNs::new("aio-share");
    const THREADS: usize = 4;
    const PER_THREAD: usize = 64;
    const BLOCK: usize = 16 << 10;
    let img = Arc::new(new_image(&ns, "img", 64 * MIB));
    let seed = |t: usize, i: usize| (t * 1000 + i) as u64;
    let offset = |t: usize, i: usize| ((t * PER_THREAD + i) * BLOCK) as u64;

    // Every thread keeps 64 writes, then 64 reads, in flight on the one
    // handle at once.
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let img = &img;
            s.spawn(move || {
                block_on(async {
                    let writes = (0..PER_THREAD)
                        .map(|i| img.aio_write(offset(t, i), pattern(seed(t, i), BLOCK)));
                    for r in join_all(writes).await {
                        r.unwrap();
                    }
                    let reads = (0..PER_THREAD).map(|i| img.aio_read(offset(t, i), BLOCK));
                    for (i, r) in join_all(reads).await.into_iter().enumerate() {
                        assert!(r.unwrap() == pattern(seed(t, i), BLOCK), "block {t}/{i}");
                    }
                })
            });
        }
    });

    // Futures are Send: submit on this thread, await on others.
    let (tx, rx) = mpsc::channel();
    for t in 0..THREADS {
        for i in 0..PER_THREAD {
            tx.send((t, i, img.aio_read(offset(t, i), BLOCK))).unwrap();
        }
    }
    drop(tx);
    let rx = std::sync::Mutex::new(rx);
    std::thread::scope(|s| {
        for _ in 0..THREADS {
            s.spawn(|| loop {
                let next = rx.lock().unwrap().recv();
                let Ok((t, i, fut)) = next else { break };
                assert!(block_on(fut).unwrap() == pattern(seed(t, i), BLOCK));
            });
        }
    });

    // Mixed writes and flushes from many "tasks" of one executor.
    block_on(async {
        let ops = (0..128).map(|i| {
            let img = Arc::clone(&img);
            async move {
                let off = 32 * MIB + i * 4096;
                img.aio_write(off, pattern(9000 + i, 4096)).await?;
                if i % 16 == 0 {
                    img.aio_flush().await?;
                }
                let back = img.aio_read(off, 4096).await?;
                assert!(back == pattern(9000 + i, 4096));
                Ok::<_, rbdkit::Error>(())
            }
        });
        for r in join_all(ops).await {
            r.unwrap();
        }
    });
}

#[test]
fn thousands_of_dropped_in_flight_futures_keep_their_buffers_and_leak_nothing() {
    let _g = exclusive();
    let ns = TestNs::new("aio-drop");
    const ROUNDS: u64 = 12;
    const PER_ROUND: usize = 400;
    const BLOCK: usize = 16 << 10;
    let img = new_image(&ns, "img", 16 * MIB);
    let seed = |round: u64, i: usize| round * 100_000 + i as u64;
    let mut rss_base = 0;
    let mut pending_at_drop = 0usize;
    let mut dropped = 0usize;
    for round in 0..ROUNDS {
        let mut kept = Vec::new();
        for i in 0..PER_ROUND {
            let off = (i * BLOCK) as u64;
            let mut w = img.aio_write(off, pattern(seed(round, i), BLOCK));
            // Every third write is awaited; the rest are polled once (so an
            // executor would have registered a waker) and dropped in flight.
            if i % 3 == 0 {
                kept.push(w);
                continue;
            }
            let _ = poll_once(&mut w);
            pending_at_drop += usize::from(!w.is_complete());
            dropped += 1;
            drop(w);
            // A read into a buffer librbd fills after its future is gone.
            let mut r = img.aio_read(off, BLOCK);
            let _ = poll_once(&mut r);
            dropped += 1;
            drop(r);
        }
        for r in block_on(join_all(kept)) {
            r.unwrap();
        }
        wait_for_no_live_requests();

        // Dropped writes are not cancelled: every block holds this round's
        // data, written from buffers that outlived their futures.
        let mut back = vec![0u8; BLOCK];
        for i in 0..PER_ROUND {
            img.read_exact((i * BLOCK) as u64, &mut back).unwrap();
            assert!(
                back == pattern(seed(round, i), BLOCK),
                "round {round}: block {i} does not hold the data written"
            );
        }
        if round == 2 {
            rss_base = vm_rss_kib();
        }
    }
    let rss_end = vm_rss_kib();
    eprintln!(
        "dropped {dropped} futures ({pending_at_drop} writes still in flight when dropped); \
         VmRSS {rss_base} KiB after round 3, {rss_end} KiB at the end"
    );
    assert!(
        pending_at_drop > 0,
        "no write was in flight when dropped; the test proves nothing"
    );
    // Each round drops ~8 MiB of buffers; a leak would grow RSS by ~70 MiB
    // over the last nine rounds.
    assert!(
        rss_end < rss_base + 48 * 1024,
        "RSS grew from {rss_base} KiB to {rss_end} KiB"
    );
    assert_eq!(aio_live_requests(), 0);
}

#[test]
fn dropping_or_closing_an_image_with_requests_in_flight() {
    let _g = exclusive();
    let ns = TestNs::new("aio-close");
    const N: usize = 256;
    const BLOCK: usize = 64 << 10;
    // A connection of its own that keeps one op in flight at the OSDs, the
    // rest queued, and all the data made before the first submission: so
    // requests are still in flight at close however fast the cluster is
    // (on an idle machine they had all completed before, and the race
    // this test is about did not happen).
    let serial = support::ceph::TestCluster::get()
        .options()
        .set("objecter_inflight_ops", "1")
        .connect()
        .unwrap();
    let io = serial.ioctx_ns(support::ceph::POOL, &ns.name).unwrap();
    let mut in_flight_at_close = 0;
    for (k, how) in ["drop", "close", "close_async"].into_iter().enumerate() {
        let name = format!("img-{how}");
        rbd::create(&io, &name, (N * BLOCK) as u64, &ImageOptions::new()).unwrap();
        let img = Image::open(&io, &name).unwrap();
        let seed = |i: usize| (k * 10_000 + i) as u64;
        let data: Vec<Vec<u8>> = (0..N).map(|i| pattern(seed(i), BLOCK)).collect();
        let writes: Vec<_> = data
            .into_iter()
            .enumerate()
            .map(|(i, d)| img.aio_write((i * BLOCK) as u64, d))
            .collect();
        let reads: Vec<_> = (0..N / 4)
            .map(|i| img.aio_read((i * BLOCK) as u64, BLOCK))
            .collect();
        let flush = img.aio_flush();
        // Futures for requests nobody will ever await.
        for i in 0..N / 4 {
            drop(img.aio_read((i * BLOCK) as u64, BLOCK));
        }
        let in_flight = writes.iter().filter(|w| !w.is_complete()).count()
            + reads.iter().filter(|r| !r.is_complete()).count()
            + usize::from(!flush.is_complete());
        eprintln!("{how}: {in_flight} requests in flight at close");
        in_flight_at_close += in_flight;
        match how {
            "drop" => drop(img),
            "close" => img.close().unwrap(),
            _ => block_on(img.close_async()).unwrap(),
        }
        // rbd_close drains the image's I/O, callbacks included: every request
        // is complete and the dropped ones are already freed.
        assert!(
            writes.iter().all(|w| w.is_complete()),
            "{how}: close returned with writes in flight"
        );
        assert!(reads.iter().all(|r| r.is_complete()));
        // Only the futures still held keep memory: the dropped ones were
        // freed by their callbacks, which all ran before close returned.
        let held = writes.len() + reads.len() + 1;
        if how == "close_async" {
            // The close's own callback may still be returning when the
            // future resolves.
            wait_for_live_requests(held);
        } else {
            assert_eq!(aio_live_requests(), held, "{how}");
        }
        for r in block_on(join_all(writes)) {
            r.unwrap();
        }
        for r in block_on(join_all(reads)) {
            assert_eq!(r.unwrap().len(), BLOCK);
        }
        block_on(flush).unwrap();
        assert_eq!(aio_live_requests(), 0);

        let img = Image::open(&ns.ioctx, &name).unwrap();
        let mut back = vec![0u8; BLOCK];
        for i in 0..N {
            img.read_exact((i * BLOCK) as u64, &mut back).unwrap();
            assert!(back == pattern(seed(i), BLOCK), "{how}: block {i}");
        }
    }
    assert!(in_flight_at_close > 0, "no request was in flight at close");
}

#[test]
fn one_shared_buffer_feeds_many_writes_and_outlives_its_owner() {
    let _g = exclusive();
    let ns = TestNs::new("aioshared");
    let img = new_image(&ns, "s", 16 * MIB);
    let block: Arc<[u8]> = pattern(42, 64 << 10).into();
    let futures: Vec<_> = (0..64u64)
        .map(|i| img.aio_write_shared(i * (64 << 10), Arc::clone(&block)))
        .collect();
    // Only the requests still hold the buffer now.
    let weak = Arc::downgrade(&block);
    drop(block);
    for r in block_on(join_all(futures)) {
        r.unwrap();
    }
    wait_for_no_live_requests();
    assert!(
        weak.upgrade().is_none(),
        "the last request freed the buffer"
    );
    let expect = pattern(42, 64 << 10);
    for i in 0..64u64 {
        let got = block_on(img.aio_read(i * (64 << 10), 64 << 10)).unwrap();
        assert!(got == expect, "block {i} differs");
    }
    // librbd's AIO path would clip a write past the end and report success;
    // rbdkit refuses it before submitting, and nothing is written.
    let e = block_on(img.aio_write_shared(16 * MIB - 10, Arc::from(&[7u8; 20][..]))).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(e.to_string().contains("past the end"), "{e}");
    let e = block_on(img.aio_write(16 * MIB - 10, vec![7u8; 20])).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let tail = block_on(img.aio_read(16 * MIB - 10, 10)).unwrap();
    assert_eq!(
        tail,
        vec![0u8; 10],
        "the refused writes left the tail alone"
    );
}

#[test]
fn aio_writes_check_their_range_without_asking_librbd_each_time() {
    let ns = TestNs::new("aio-size");
    rbd::create(&ns.ioctx, "img", 4 << 20, &ImageOptions::new()).unwrap();
    let img = Image::open(&ns.ioctx, "img").unwrap();
    let before = img.io_size_lookups();
    let writes: Vec<_> = (0..64u64)
        .map(|i| img.aio_write(i * 4096, pattern(i, 4096)))
        .collect();
    for r in block_on(join_all(writes)) {
        r.unwrap();
    }
    assert_eq!(img.io_size_lookups(), before, "no rbd_get_size per write");

    // Another client grows it: a write past the old end looks once.
    let other = support::ceph::TestCluster::get().connect();
    let io = other.ioctx_ns(support::ceph::POOL, &ns.name).unwrap();
    Image::open(&io, "img").unwrap().resize(8 << 20).unwrap();
    block_on(img.aio_write(6 << 20, vec![1u8; 4096])).unwrap();
    assert_eq!(img.io_size_lookups(), before + 1);
    block_on(img.aio_write(6 << 20, vec![2u8; 4096])).unwrap();
    assert_eq!(img.io_size_lookups(), before + 1, "cached again");
    // Past the real end: still refused.
    let e = block_on(img.aio_write((8 << 20) - 100, vec![3u8; 4096])).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
}
