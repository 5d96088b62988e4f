// Command goceph-bench is go-ceph's contender in rbdkit's side-by-side
// benchmarks (see bench/README.md). Build it with the Pacific tag:
//
//	go build -tags pacific -o goceph-bench .
//
// Same command line and JSON output as bench/rbdkit-bench:
//
//	goceph-bench control     --conf C --pool P --prefix X --cycles N --size B
//	goceph-bench concurrency --conf C --pool P --prefix X --threads T --images M --size B
//	goceph-bench data        --conf C --pool P --image I --workload W --bs B --qd Q --ops N
//
// go-ceph's image I/O is synchronous only (ReadAt/WriteAt over rbd_read and
// rbd_write), so data mode gets its queue depth from qd goroutines that each
// make one blocking call at a time on the shared image.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ceph/go-ceph/rados"
	"github.com/ceph/go-ceph/rbd"
)

type opts map[string]string

func (o opts) str(key string) string {
	v, ok := o[key]
	if !ok {
		fail(fmt.Errorf("missing option --%s", key))
	}
	return v
}

func (o opts) num(key string) uint64 {
	v, err := strconv.ParseUint(o.str(key), 10, 64)
	if err != nil {
		fail(fmt.Errorf("option --%s: %v", key, err))
	}
	return v
}

func fail(err error) {
	fmt.Fprintf(os.Stderr, "goceph-bench: %v\n", err)
	os.Exit(1)
}

func check(err error) {
	if err != nil {
		fail(err)
	}
}

func main() {
	if len(os.Args) < 2 || len(os.Args)%2 != 0 {
		fail(fmt.Errorf("usage: goceph-bench control|concurrency|data --key value ..."))
	}
	mode := os.Args[1]
	o := opts{}
	for i := 2; i < len(os.Args); i += 2 {
		k, ok := strings.CutPrefix(os.Args[i], "--")
		if !ok {
			fail(fmt.Errorf("expected --option, got %q", os.Args[i]))
		}
		o[k] = os.Args[i+1]
	}

	start := time.Now()
	conn, err := rados.NewConn()
	check(err)
	check(conn.ReadConfigFile(o.str("conf")))
	check(conn.Connect())
	ioctx, err := conn.OpenIOContext(o.str("pool"))
	check(err)
	out := map[string]any{
		"contender":  "go-ceph",
		"mode":       mode,
		"connect_ms": ms(time.Since(start)),
	}
	switch mode {
	case "control":
		control(o, ioctx, out)
	case "concurrency":
		concurrency(o, ioctx, out)
	case "data":
		data(o, ioctx, out)
	default:
		fail(fmt.Errorf("unknown mode %q", mode))
	}
	ioctx.Destroy()
	conn.Shutdown()
	out["total_s"] = time.Since(start).Seconds()
	b, err := json.Marshal(out)
	check(err)
	fmt.Println(string(b))
}

func ms(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e6 }

var ops = []string{"create", "open", "stat", "resize", "close", "remove"}

// cycle runs create -> open -> stat -> resize -> close -> remove and returns
// the milliseconds of each step.
func cycle(ioctx *rados.IOContext, name string, size uint64) []float64 {
	t := make([]float64, 0, len(ops))
	clock := time.Now()
	lap := func() {
		now := time.Now()
		t = append(t, ms(now.Sub(clock)))
		clock = now
	}
	options := rbd.NewRbdImageOptions()
	check(rbd.CreateImage(ioctx, name, size, options))
	options.Destroy()
	lap()
	img, err := rbd.OpenImage(ioctx, name, rbd.NoSnapshot)
	check(err)
	lap()
	info, err := img.Stat()
	check(err)
	lap()
	check(img.Resize(info.Size * 2))
	lap()
	check(img.Close())
	lap()
	check(rbd.RemoveImage(ioctx, name))
	lap()
	return t
}

func control(o opts, ioctx *rados.IOContext, out map[string]any) {
	cycles, size, prefix := int(o.num("cycles")), o.num("size"), o.str("prefix")
	times := map[string][]float64{}
	for i := 0; i <= cycles; i++ {
		t := cycle(ioctx, fmt.Sprintf("%s-%d", prefix, i), size)
		if i == 0 {
			continue // warm-up
		}
		sum := 0.0
		for k, op := range ops {
			times[op] = append(times[op], t[k])
			sum += t[k]
		}
		times["cycle"] = append(times["cycle"], sum)
	}
	out["ops_ms"] = times
}

// phase runs op(0..count) on `workers` goroutines and returns the wall time.
func phase(workers, count int, op func(int) error) float64 {
	var next atomic.Int64
	var wg sync.WaitGroup
	var once sync.Once
	var firstErr error
	start := time.Now()
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= count {
					return
				}
				if err := op(i); err != nil {
					once.Do(func() { firstErr = err })
					next.Store(int64(count))
					return
				}
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start).Seconds()
	check(firstErr)
	return elapsed
}

func concurrency(o opts, ioctx *rados.IOContext, out map[string]any) {
	threads, images := int(o.num("threads")), int(o.num("images"))
	size, prefix := o.num("size"), o.str("prefix")
	out["threads"] = threads
	out["images"] = images
	out["create_s"] = phase(threads, images, func(i int) error {
		options := rbd.NewRbdImageOptions()
		defer options.Destroy()
		return rbd.CreateImage(ioctx, fmt.Sprintf("%s-%d", prefix, i), size, options)
	})
	out["remove_s"] = phase(threads, images, func(i int) error {
		return rbd.RemoveImage(ioctx, fmt.Sprintf("%s-%d", prefix, i))
	})
}

// splitmix64 is the offset hash every contender shares.
func splitmix64(x uint64) uint64 {
	z := x + 0x9E3779B97F4A7C15
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
	z = (z ^ (z >> 27)) * 0x94D049BB133111EB
	return z ^ (z >> 31)
}

func data(o opts, ioctx *rados.IOContext, out map[string]any) {
	workload := o.str("workload")
	write := strings.HasSuffix(workload, "write")
	random := strings.HasPrefix(workload, "rand")
	if workload != "seqwrite" && workload != "seqread" && workload != "randwrite" && workload != "randread" {
		fail(fmt.Errorf("unknown workload %q", workload))
	}
	bs, qd, total := o.num("bs"), int(o.num("qd")), o.num("ops")
	if qd < 1 {
		qd = 1
	}
	img, err := rbd.OpenImage(ioctx, o.str("image"), rbd.NoSnapshot)
	check(err)
	// As rbd bench does first: puts librbd's cache in write-back mode.
	check(img.Flush())
	size, err := img.GetSize()
	check(err)
	blocks := size / bs
	pattern := make([]byte, bs)
	for i := range pattern {
		pattern[i] = byte((i*31)%251 + 1)
	}
	offset := func(i uint64) int64 {
		if random {
			return int64(splitmix64(i) % blocks * bs)
		}
		return int64(i % blocks * bs)
	}
	var next atomic.Uint64
	var wg sync.WaitGroup
	var once sync.Once
	var firstErr error
	start := time.Now()
	for w := 0; w < qd; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, bs)
			for {
				i := next.Add(1) - 1
				if i >= total {
					return
				}
				var err error
				if write {
					_, err = img.WriteAt(pattern, offset(i))
				} else {
					_, err = img.ReadAt(buf, offset(i))
				}
				if err != nil {
					once.Do(func() { firstErr = err })
					next.Store(total)
					return
				}
			}
		}()
	}
	wg.Wait()
	check(firstErr)
	if write {
		check(img.Flush())
	}
	elapsed := time.Since(start).Seconds()
	check(img.Close())
	out["engine"] = "goroutines"
	out["workload"] = workload
	out["bs"] = bs
	out["qd"] = qd
	out["ops"] = total
	out["elapsed_s"] = elapsed
	out["iops"] = float64(total) / elapsed
	out["mib_s"] = float64(total*bs) / elapsed / (1 << 20)
}
