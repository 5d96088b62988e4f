/* The two public Ceph headers rbd-sys binds. */
#include <rados/librados.h>
#include <rbd/librbd.h>
