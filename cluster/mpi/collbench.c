/*
 * collbench: times MPI collectives the way the MPI benchmarks do, and prints one JSON line per
 * collective and size with the fields of `phalanx bench --json`, so that
 * cluster/compare-mpi.sh can put Open MPI and Phalanx side by side.
 *
 *   mpirun ... collbench [-c broadcast,reduce,allreduce,gather] [-s 1K,64K,1M,16M,64M]
 *                        [-n ITERS[,ITERS...]] [-w WARMUP[,WARMUP...]] [-a ALGO] [-t TRANSPORT]
 *
 *   -c  collectives, in this order: broadcast (MPI_Bcast of `size` bytes from rank 0),
 *       reduce (MPI_Reduce, sum of size/4 float32 to rank 0), allreduce (MPI_Allreduce, sum of
 *       size/4 float32), gather (MPI_Gather to rank 0, `size` bytes from every rank);
 *   -s  sizes: bytes of the object per rank (suffix K, M, G: powers of 1024, as phalanx);
 *   -n  timed iterations per size (one value for all sizes, or one per size; default 20);
 *   -w  warm-up iterations per size (likewise; default 2);
 *   -a  the "algo" label of the records (e.g. mpi-default, mpi-tuned-binomial): the algorithm
 *       itself is chosen by the MCA parameters given to mpirun, not by this program;
 *   -t  the "transport" label (default tcp);
 *   -i  arrival interval in milliseconds (default 0): after the barrier, rank r waits r * this
 *       long before it enters the collective (its input becomes ready late, as `phalanx bench
 *       --arrival-interval-ms` does for reduce, allreduce and gather); the record then also
 *       carries "after_last_median_s": the iteration's time minus (N-1) * interval, i.e. from
 *       the last rank's arrival to the last rank done (the rule of phalanx bench's "after last").
 *
 * Timing of one iteration, the rule of `phalanx bench` (cli/src/bench/sync.rs): MPI_Barrier;
 * every rank reads t0 = CLOCK_MONOTONIC as it leaves the barrier; the collective; every rank
 * reads t1. When every rank runs on one kernel (equal /proc/sys/kernel/random/boot_id, as on
 * the emulated hosts), they share that clock and the iteration's time is the last t1 minus the
 * first t0: the barrier's exit skew counts, as it does for Phalanx. Otherwise it is the largest
 * t1 - t0 over the ranks (each rank's own span). Both are computed after the timed loop from
 * the gathered stamps, outside the timing; the record also carries "median_own_span_s", the
 * median of the largest own span (the OSU rule), for reference.
 * Over the timed iterations the record gives median (element n/2 of the sorted times, as
 * phalanx bench), min, max and p99 (nearest rank), and throughput = size * 8 / median.
 *
 * Every result is checked after the loop (every byte of a broadcast or gather, every float of
 * a reduce or allreduce); a wrong result aborts the run. Rank 0 also prints, as "#" lines,
 * the IPv4 address each rank runs behind, so a launcher can check the placement.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <math.h>
#include <mpi.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum coll { BCAST, REDUCE, ALLREDUCE, GATHER, NCOLL };
static const char *const coll_name[NCOLL] = {"broadcast", "reduce", "allreduce", "gather"};

#define MAX_LIST 64
#define ADDR_LEN 64

static int rank, nranks;

static void die(const char *what)
{
    fprintf(stderr, "collbench (rank %d): %s\n", rank, what);
    MPI_Abort(MPI_COMM_WORLD, 2);
    exit(2); /* not reached */
}

static void check(int rc, const char *call)
{
    if (rc != MPI_SUCCESS) {
        char msg[MPI_MAX_ERROR_STRING + 64];
        char err[MPI_MAX_ERROR_STRING];
        int len = 0;
        MPI_Error_string(rc, err, &len);
        snprintf(msg, sizeof msg, "%s failed: %s", call, err);
        die(msg);
    }
}

/* Seconds on this host's monotonic clock (shared by every process of one kernel). */
static double mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* FNV-1a of this kernel's boot id (0 when unreadable): equal on every rank of one host. */
static unsigned long long boot_id_hash(void)
{
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (!f)
        return 0;
    char buf[64] = {0};
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    unsigned long long h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n && buf[i] != '\n'; i++)
        h = (h ^ (unsigned char)buf[i]) * 0x100000001b3ULL;
    return h;
}

/* "64K" -> 65536; 0 on a malformed value. */
static uint64_t parse_size(const char *s)
{
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s)
        return 0;
    switch (*end) {
    case 'k': case 'K': v <<= 10; end++; break;
    case 'm': case 'M': v <<= 20; end++; break;
    case 'g': case 'G': v <<= 30; end++; break;
    default: break;
    }
    return *end == '\0' ? (uint64_t)v : 0;
}

/* Splits a comma-separated list in place; returns the number of items. */
static int split(char *s, char **items)
{
    int n = 0;
    for (char *tok = strtok(s, ","); tok; tok = strtok(NULL, ",")) {
        if (n == MAX_LIST)
            die("too many list items");
        items[n++] = tok;
    }
    return n;
}

/* One value for every size, or one per size. */
static void parse_counts(char *s, long *out, int nsizes, long min, const char *opt)
{
    char *items[MAX_LIST];
    char msg[128];
    int n = split(s, items);
    if (n != 1 && n != nsizes) {
        snprintf(msg, sizeof msg, "%s takes one value or one per size (%d)", opt, nsizes);
        die(msg);
    }
    for (int i = 0; i < nsizes; i++) {
        char *end;
        long v = strtol(items[n == 1 ? 0 : i], &end, 10);
        if (*end != '\0' || v < min) {
            snprintf(msg, sizeof msg, "bad value for %s: %s", opt, items[n == 1 ? 0 : i]);
            die(msg);
        }
        out[i] = v;
    }
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p)
        die("out of memory");
    return p;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Test data: byte i of rank r's input, and float i of rank r's input (small integers, so a
 * float sum over the ranks is exact in any order). */
static unsigned char pattern_byte(int r, size_t i) { return (unsigned char)((i * 131u + (size_t)r * 29u + 7u) & 0xff); }
static float pattern_float(int r, size_t i) { return (float)((r + 1) * (int)(i % 13 + 1)); }

struct buffers {
    unsigned char *in, *out;
};

/* Allocates and fills the inputs; outputs are zeroed (and touched, so no page fault lands in
 * a timed iteration). */
static struct buffers setup(enum coll c, size_t size)
{
    struct buffers b = {NULL, NULL};
    size_t nf = size / sizeof(float);
    switch (c) {
    case BCAST:
        b.in = xmalloc(size);
        if (rank == 0)
            for (size_t i = 0; i < size; i++) b.in[i] = pattern_byte(0, i);
        else
            memset(b.in, 0, size);
        break;
    case REDUCE:
    case ALLREDUCE: {
        float *in = xmalloc(nf * sizeof(float));
        for (size_t i = 0; i < nf; i++) in[i] = pattern_float(rank, i);
        b.in = (unsigned char *)in;
        if (c == ALLREDUCE || rank == 0) {
            b.out = xmalloc(nf * sizeof(float));
            memset(b.out, 0, nf * sizeof(float));
        }
        break;
    }
    case GATHER:
        b.in = xmalloc(size);
        for (size_t i = 0; i < size; i++) b.in[i] = pattern_byte(rank, i);
        if (rank == 0) {
            b.out = xmalloc(size * (size_t)nranks);
            memset(b.out, 0, size * (size_t)nranks);
        }
        break;
    default:
        die("unknown collective");
    }
    return b;
}

static void run_once(enum coll c, struct buffers *b, size_t size)
{
    int count;
    switch (c) {
    case BCAST:
        check(MPI_Bcast(b->in, (int)size, MPI_BYTE, 0, MPI_COMM_WORLD), "MPI_Bcast");
        break;
    case REDUCE:
        count = (int)(size / sizeof(float));
        check(MPI_Reduce(b->in, b->out, count, MPI_FLOAT, MPI_SUM, 0, MPI_COMM_WORLD), "MPI_Reduce");
        break;
    case ALLREDUCE:
        count = (int)(size / sizeof(float));
        check(MPI_Allreduce(b->in, b->out, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD), "MPI_Allreduce");
        break;
    case GATHER:
        check(MPI_Gather(b->in, (int)size, MPI_BYTE, b->out, (int)size, MPI_BYTE, 0, MPI_COMM_WORLD),
              "MPI_Gather");
        break;
    default:
        die("unknown collective");
    }
}

/* Returns the index of the first wrong element, or -1. */
static long verify(enum coll c, const struct buffers *b, size_t size)
{
    size_t nf = size / sizeof(float);
    float sum_ranks = (float)nranks * (float)(nranks + 1) / 2.0f;
    switch (c) {
    case BCAST:
        for (size_t i = 0; i < size; i++)
            if (b->in[i] != pattern_byte(0, i)) return (long)i;
        break;
    case REDUCE:
    case ALLREDUCE:
        if (!b->out) break;
        for (size_t i = 0; i < nf; i++)
            if (((const float *)b->out)[i] != sum_ranks * (float)(i % 13 + 1)) return (long)i;
        break;
    case GATHER:
        if (!b->out) break;
        for (int r = 0; r < nranks; r++)
            for (size_t i = 0; i < size; i++)
                if (b->out[(size_t)r * size + i] != pattern_byte(r, i)) return (long)((size_t)r * size + i);
        break;
    default:
        break;
    }
    return -1;
}

/* The first IPv4 address of a non-loopback interface ("?" if none). */
static void my_address(char *buf)
{
    struct ifaddrs *ifs, *it;
    snprintf(buf, ADDR_LEN, "?");
    if (getifaddrs(&ifs) != 0)
        return;
    for (it = ifs; it; it = it->ifa_next) {
        if (!it->ifa_addr || it->ifa_addr->sa_family != AF_INET)
            continue;
        const struct sockaddr_in *sin = (const struct sockaddr_in *)(const void *)it->ifa_addr;
        if ((ntohl(sin->sin_addr.s_addr) >> 24) == 127)
            continue;
        char a[INET_ADDRSTRLEN];
        if (inet_ntop(AF_INET, &sin->sin_addr, a, sizeof a))
            snprintf(buf, ADDR_LEN, "%s %s", it->ifa_name, a);
        break;
    }
    freeifaddrs(ifs);
}

/* A JSON string's contents: printable ASCII only, no quotes or backslashes. */
static void json_safe(char *s)
{
    for (; *s; s++)
        if (*s < 0x20 || *s > 0x7e || *s == '"' || *s == '\\') *s = '_';
}

int main(int argc, char **argv)
{
    char colls_s[256] = "broadcast,reduce,allreduce,gather";
    char sizes_s[256] = "1K,64K,1M,16M,64M";
    char iters_s[256] = "20", warm_s[256] = "2";
    char algo[128] = "mpi-default", transport[64] = "tcp";
    double interval_s = 0;
    int opt;

    check(MPI_Init(&argc, &argv), "MPI_Init");
    check(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
    check(MPI_Comm_size(MPI_COMM_WORLD, &nranks), "MPI_Comm_size");

    while ((opt = getopt(argc, argv, "c:s:n:w:a:t:i:h")) != -1) {
        switch (opt) {
        case 'c': snprintf(colls_s, sizeof colls_s, "%s", optarg); break;
        case 's': snprintf(sizes_s, sizeof sizes_s, "%s", optarg); break;
        case 'n': snprintf(iters_s, sizeof iters_s, "%s", optarg); break;
        case 'w': snprintf(warm_s, sizeof warm_s, "%s", optarg); break;
        case 'a': snprintf(algo, sizeof algo, "%s", optarg); break;
        case 't': snprintf(transport, sizeof transport, "%s", optarg); break;
        case 'i': {
            char *end;
            double ms = strtod(optarg, &end);
            if (*end != '\0' || !(ms >= 0) || ms > 60000) die("-i wants milliseconds in 0..60000");
            interval_s = ms / 1e3;
            break;
        }
        default:
            if (rank == 0)
                fprintf(stderr, "usage: collbench [-c broadcast,reduce,allreduce,gather] [-s 1K,64K,1M] "
                                "[-n ITERS[,..]] [-w WARMUP[,..]] [-a ALGO] [-t TRANSPORT] [-i INTERVAL_MS]\n");
            MPI_Finalize();
            return opt == 'h' ? 0 : 2;
        }
    }
    json_safe(algo);
    json_safe(transport);

    char *items[MAX_LIST];
    int ncolls = split(colls_s, items);
    enum coll colls[MAX_LIST];
    for (int i = 0; i < ncolls; i++) {
        int found = -1;
        for (int c = 0; c < NCOLL; c++)
            if (strcmp(items[i], coll_name[c]) == 0) found = c;
        if (strcmp(items[i], "bcast") == 0) found = BCAST;
        if (found < 0) die("unknown collective (broadcast, reduce, allreduce, gather)");
        colls[i] = (enum coll)found;
    }
    int nsizes = split(sizes_s, items);
    uint64_t sizes[MAX_LIST];
    for (int i = 0; i < nsizes; i++) {
        sizes[i] = parse_size(items[i]);
        if (sizes[i] < sizeof(float) || sizes[i] > (uint64_t)INT32_MAX)
            die("bad size (4 bytes .. 2 GiB - 1; suffix K, M, G)");
    }
    long iters[MAX_LIST], warm[MAX_LIST];
    parse_counts(iters_s, iters, nsizes, 1, "-n");
    parse_counts(warm_s, warm, nsizes, 0, "-w");

    /* Library and placement, for the log. */
    char addr[ADDR_LEN];
    my_address(addr);
    char *addrs = rank == 0 ? xmalloc((size_t)ADDR_LEN * (size_t)nranks) : NULL;
    check(MPI_Gather(addr, ADDR_LEN, MPI_CHAR, addrs, ADDR_LEN, MPI_CHAR, 0, MPI_COMM_WORLD), "MPI_Gather");
    if (rank == 0) {
        char lib[MPI_MAX_LIBRARY_VERSION_STRING];
        int len = 0;
        check(MPI_Get_library_version(lib, &len), "MPI_Get_library_version");
        lib[strcspn(lib, ",\n")] = '\0';
        printf("# collbench: %s, %d ranks, MPI_Wtick %.3g s, algo %s\n", lib, nranks, MPI_Wtick(), algo);
        for (int r = 0; r < nranks; r++)
            printf("# rank %d: %s\n", r, addrs + (size_t)r * ADDR_LEN);
        fflush(stdout);
        free(addrs);
    }

    /* One clock for all ranks when they share a kernel. */
    unsigned long long boot = boot_id_hash(), boot_min = 0, boot_max = 0;
    check(MPI_Allreduce(&boot, &boot_min, 1, MPI_UNSIGNED_LONG_LONG, MPI_MIN, MPI_COMM_WORLD), "MPI_Allreduce");
    check(MPI_Allreduce(&boot, &boot_max, 1, MPI_UNSIGNED_LONG_LONG, MPI_MAX, MPI_COMM_WORLD), "MPI_Allreduce");
    int shared_clock = boot != 0 && boot_min == boot_max;
    if (rank == 0) {
        printf("# clock: %s\n", shared_clock ? "shared by every rank (one kernel): last t1 - first t0"
                                              : "per rank: largest own span");
        fflush(stdout);
    }

    for (int ci = 0; ci < ncolls; ci++) {
        enum coll c = colls[ci];
        for (int si = 0; si < nsizes; si++) {
            size_t size = (size_t)sizes[si];
            long n = iters[si], w = warm[si];
            struct buffers b = setup(c, size);
            /* stamp[2k] = t0, stamp[2k+1] = t1 of timed iteration k. */
            double *stamp = xmalloc((size_t)n * 2 * sizeof(double));
            double *all = rank == 0 ? xmalloc((size_t)n * 2 * (size_t)nranks * sizeof(double)) : NULL;
            double *worst = rank == 0 ? xmalloc((size_t)n * sizeof(double)) : NULL;
            double *own = rank == 0 ? xmalloc((size_t)n * sizeof(double)) : NULL;
            double *skew = rank == 0 ? xmalloc((size_t)n * sizeof(double)) : NULL;

            for (long it = 0; it < w + n; it++) {
                check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
                double t0 = mono_now();
                if (interval_s > 0 && rank > 0) {
                    double ready = t0 + interval_s * rank;
                    while (mono_now() < ready) {
                        double left = ready - mono_now();
                        struct timespec ts = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
                        nanosleep(&ts, NULL);
                    }
                }
                run_once(c, &b, size);
                double t1 = mono_now();
                if (it >= w) {
                    stamp[2 * (it - w)] = t0;
                    stamp[2 * (it - w) + 1] = t1;
                }
            }
            check(MPI_Gather(stamp, (int)(2 * n), MPI_DOUBLE, all, (int)(2 * n), MPI_DOUBLE, 0, MPI_COMM_WORLD),
                  "MPI_Gather");
            if (rank == 0) {
                for (long k = 0; k < n; k++) {
                    double first0 = INFINITY, last0 = -INFINITY, last1 = -INFINITY, span = 0;
                    for (int r = 0; r < nranks; r++) {
                        const double *st = all + (size_t)r * 2 * (size_t)n + 2 * (size_t)k;
                        if (st[0] < first0) first0 = st[0];
                        if (st[0] > last0) last0 = st[0];
                        if (st[1] > last1) last1 = st[1];
                        if (st[1] - st[0] > span) span = st[1] - st[0];
                    }
                    own[k] = span;
                    skew[k] = last0 - first0;
                    worst[k] = shared_clock ? last1 - first0 : span;
                }
            }

            long bad = verify(c, &b, size);
            if (bad >= 0) {
                char msg[160];
                snprintf(msg, sizeof msg, "%s of %zu bytes: wrong result at element %ld", coll_name[c], size, bad);
                die(msg);
            }
            /* Nobody reports before everyone has checked. */
            check(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");

            if (rank == 0) {
                qsort(worst, (size_t)n, sizeof(double), cmp_double);
                qsort(own, (size_t)n, sizeof(double), cmp_double);
                qsort(skew, (size_t)n, sizeof(double), cmp_double);
                double med = worst[n / 2];
                long p99 = (long)ceil(0.99 * (double)n) - 1;
                if (p99 < 0) p99 = 0;
                printf("{\"collective\":\"%s\",\"algo\":\"%s\",\"transport\":\"%s\",\"nodes\":%d,"
                       "\"size_bytes\":%zu,\"iters\":%ld,\"warmup\":%ld,\"median_s\":%.9g,\"min_s\":%.9g,"
                       "\"max_s\":%.9g,\"p99_s\":%.9g,\"throughput_gbit_s\":%.9g,\"median_own_span_s\":%.9g,"
                       "\"arrival_interval_ms\":%.9g,\"after_last_median_s\":%.9g,"
                       "\"barrier_skew_median_s\":%.9g}\n",
                       coll_name[c], algo, transport, nranks, size, n, w, med, worst[0], worst[n - 1],
                       worst[p99], (double)size * 8.0 / med / 1e9, own[n / 2], interval_s * 1e3,
                       fmax(0.0, med - interval_s * (nranks - 1)), shared_clock ? skew[n / 2] : 0.0);
                fflush(stdout);
            }
            free(stamp);
            free(all);
            free(own);
            free(skew);
            free(worst);
            free(b.in);
            free(b.out);
        }
    }
    check(MPI_Finalize(), "MPI_Finalize");
    return 0;
}
