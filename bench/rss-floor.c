/*
 * rss-floor: the resident memory any librbd client pays before it does
 * anything of its own (bench/burst.py runs it after its RSS run). It links
 * only librados and librbd, connects, runs CYCLES create/open/stat/close/
 * remove cycles in POOL and prints its VmRSS at three points and its VmHWM,
 * in KiB, as one JSON line.
 *
 *   rss-floor CEPH_CONF POOL [CYCLES]
 *
 * Every call is bounded by the conf's timeouts (set here too).
 */
#include <rados/librados.h>
#include <rbd/librbd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static long status_kib(const char *field)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long v = -1;
    size_t n = strlen(field);
    if (!f)
        return -1;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, field, n) && line[n] == ':')
            v = atol(line + n + 1);
    fclose(f);
    return v;
}

static void die(const char *what, int r)
{
    fprintf(stderr, "rss-floor: %s: %s\n", what, strerror(-r));
    exit(1);
}

int main(int argc, char **argv)
{
    rados_t cluster;
    rados_ioctx_t io;
    int cycles = argc > 3 ? atoi(argv[3]) : 50, order = 22, r;
    long loaded, connected;

    if (argc < 3) {
        fprintf(stderr, "usage: rss-floor CEPH_CONF POOL [CYCLES]\n");
        return 2;
    }
    loaded = status_kib("VmRSS");
    if ((r = rados_create(&cluster, "admin")) < 0)
        die("rados_create", r);
    if ((r = rados_conf_read_file(cluster, argv[1])) < 0)
        die("rados_conf_read_file", r);
    /* The provisioner's control connections run without the cache too. */
    rados_conf_set(cluster, "rbd_cache", "false");
    rados_conf_set(cluster, "client_mount_timeout", "30");
    rados_conf_set(cluster, "rados_mon_op_timeout", "30");
    rados_conf_set(cluster, "rados_osd_op_timeout", "30");
    if ((r = rados_connect(cluster)) < 0)
        die("rados_connect", r);
    connected = status_kib("VmRSS");
    if ((r = rados_ioctx_create(cluster, argv[2], &io)) < 0)
        die("rados_ioctx_create", r);
    for (int i = 0; i < cycles; i++) {
        char name[64];
        rbd_image_t image;
        rbd_image_info_t info;
        snprintf(name, sizeof name, "rss-floor-%d-%d", (int)getpid(), i);
        if ((r = rbd_create2(io, name, 1 << 30, 1 /* layering */, &order)) < 0)
            die("rbd_create2", r);
        if ((r = rbd_open(io, name, &image, NULL)) < 0)
            die("rbd_open", r);
        if ((r = rbd_stat(image, &info, sizeof info)) < 0)
            die("rbd_stat", r);
        if ((r = rbd_close(image)) < 0)
            die("rbd_close", r);
        if ((r = rbd_remove(io, name)) < 0)
            die("rbd_remove", r);
    }
    printf("{\"loaded_kib\": %ld, \"connected_kib\": %ld, \"after_cycles_kib\": %ld, "
           "\"hwm_kib\": %ld, \"cycles\": %d}\n",
           loaded, connected, status_kib("VmRSS"), status_kib("VmHWM"), cycles);
    rados_ioctx_destroy(io);
    rados_shutdown(cluster);
    return 0;
}
