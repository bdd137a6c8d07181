/* Row copies between a serving engine's paged KV memory and chunk payloads, in C:
 * lmcache_async.transfer._rows.gather_rows and scatter_rows (lmcache_async.transfer.native
 * builds their arguments once per transfer plan).
 *
 * One call moves every job (a chunk: tokens [start, end) and its payload) x payload part
 * (K, V or the MLA latent) x layer. A part's rows lie in each layer's memory at
 * base + index * row_stride; a row is a grid of up to MAX_DIMS strided dimensions of
 * contiguous segments, flattened in order into the payload. Rows adjacent in memory whose
 * payload rows are adjacent too (a vLLM block's tokens, in NHD layouts) go in one memcpy.
 * Only bytes move, so every dtype is the same copy.
 *
 * Why C: torch's index_select / index_copy_ cost tens of microseconds each whatever their
 * size, and a plan issued one per chunk x layer x part: most of a small request's time.
 *
 * The table (int64, one per plan) holds, in order:
 *   header           parts, layers, tokens, rows_per_token
 *   per part         row_bytes, seg_bytes, ndims, count[MAX_DIMS], stride[MAX_DIMS]
 *                    (bytes; the first ndims entries are used, outermost first)
 *   per part, layer  base address, rows, row_stride (bytes)
 * index: per part an int64 buffer of tokens * rows_per_token row numbers, token-major.
 * The payload of a job holds, per part then per layer, its tokens' rows (layer = -1);
 * a per-layer payload (layer >= 0) holds, per token, each part's rows in turn.
 *
 * Addresses (the views' bases, the payloads) are trusted: the caller keeps the memory
 * alive and sized as the table says. Everything else is checked before a byte moves:
 * sizes, ranges, every row number of the jobs against its views' row count.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define MAX_DIMS 4
#define MAX_PARTS 8
#define HEADER_FIELDS 4
#define PART_FIELDS (3 + 2 * MAX_DIMS)
#define VIEW_FIELDS 3
#define MAX_THREADS 64
/* Below this many bytes the GIL is kept: handing it over costs more than the copy. */
#define RELEASE_GIL_BYTES (64 * 1024)

typedef struct {
    const int64_t *index; /* tokens * rows_per_token row numbers */
    int64_t rows;         /* the fewest rows of the part's views */
    int64_t row_bytes;
    int64_t seg_bytes;
    int64_t count[MAX_DIMS]; /* padded in front with 1s (stride 0) */
    int64_t stride[MAX_DIMS];
    int64_t run_step; /* index step from a row to the next one in memory; 0: none */
} Part;

typedef struct {
    char *base;
    int64_t row_stride;
} View;

typedef struct {
    int64_t start, end;
    char *payload;
} Job;

typedef struct {
    int scatter;
    int stream;                /* stores that go around the caches (a large copy) */
    int64_t parts, layers, rpt;
    int64_t layer;             /* -1: every layer, whole payloads; else that layer only */
    int64_t token_part_bytes;  /* one token's bytes in one part and layer */
    int64_t job_rows;          /* rows of one part and layer, over every job */
    const Part *part;
    const View *view;          /* parts x layers */
    const Job *job;
    Py_ssize_t jobs;
    const uint8_t *skip;       /* per token of the plan, nonzero: never written; or NULL */
} Copy;

/* `count` segments of `SIZE` bytes, `stride` apart in the row, packed in the payload. */
#define SEGMENTS(SIZE)                                                  \
    do {                                                                \
        if (scatter) {                                                  \
            for (int64_t d = 0; d < count; d++)                         \
                memcpy(row + d * stride, out + d * (SIZE), (SIZE));     \
        } else {                                                        \
            for (int64_t d = 0; d < count; d++)                         \
                memcpy(out + d * (SIZE), row + d * stride, (SIZE));     \
        }                                                               \
    } while (0)

static void copy_segments(char *row, int64_t stride, int64_t count, char *out, int64_t seg,
                          int scatter) {
    switch (seg) {
    case 2: SEGMENTS(2); break;
    case 4: SEGMENTS(4); break;
    case 8: SEGMENTS(8); break;
    case 16: SEGMENTS(16); break;
    default: SEGMENTS(seg); break;
    }
}

#if defined(__SSE2__)
#include <emmintrin.h>
/* `n` bytes with stores that go around the caches: a large copy's destination is not
 * read back soon, and a cached store first reads the line it writes. */
static void stream_bytes(char *dst, const char *src, int64_t n) {
    int64_t head = (int64_t)(-(uintptr_t)dst & 15);
    if (head > n) head = n;
    memcpy(dst, src, (size_t)head);
    dst += head, src += head, n -= head;
    for (; n >= 64; dst += 64, src += 64, n -= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    for (; n >= 16; dst += 16, src += 16, n -= 16)
        _mm_stream_si128((__m128i *)dst, _mm_loadu_si128((const __m128i *)src));
    memcpy(dst, src, (size_t)n);
}
#define STREAM_FENCE() _mm_sfence()
#else
#define stream_bytes(dst, src, n) memcpy((dst), (src), (size_t)(n))
#define STREAM_FENCE() ((void)0)
#endif

/* `n` bytes; the sizes of common rows (one head, or a token of a few) inlined, where a
 * call to memcpy would cost as much as the copy. */
static inline void copy_bytes(char *dst, const char *src, int64_t n) {
    switch (n) {
    case 64: memcpy(dst, src, 64); break;
    case 128: memcpy(dst, src, 128); break;
    case 256: memcpy(dst, src, 256); break;
    default: memcpy(dst, src, (size_t)n); break;
    }
}

/* One row between the view (`row`) and the payload (`out`, packed). */
static void copy_row(char *row, char *out, const Part *p, int scatter, int stream) {
    if (p->row_bytes == p->seg_bytes) {
        char *dst = scatter ? row : out, *src = scatter ? out : row;
        if (stream) stream_bytes(dst, src, p->row_bytes);
        else copy_bytes(dst, src, p->row_bytes);
        return;
    }
    const int64_t *n = p->count, *s = p->stride;
    const int64_t inner = n[3] * p->seg_bytes;
    for (int64_t a = 0; a < n[0]; a++)
        for (int64_t b = 0; b < n[1]; b++)
            for (int64_t c = 0; c < n[2]; c++) {
                copy_segments(row + a * s[0] + b * s[1] + c * s[2], s[3], n[3], out,
                              p->seg_bytes, scatter);
                out += inner;
            }
}

/* Rows [lo, hi) of one job, part `p` and layer `l`. */
static void copy_unit(const Copy *c, const Job *job, int64_t p, int64_t l, int64_t lo,
                      int64_t hi) {
    const Part *part = &c->part[p];
    const View *view = &c->view[p * c->layers + l];
    const int64_t rpt = c->rpt, tpb = c->token_part_bytes, rb = part->row_bytes;
    const int64_t tokens = job->end - job->start, row_stride = view->row_stride;
    const int scatter = c->scatter, stream = c->stream;
    char *payload, *base = view->base;
    int64_t token_stride;
    if (c->layer < 0) {
        payload = job->payload + (p * c->layers + l) * tokens * tpb;
        token_stride = tpb;
    } else {
        payload = job->payload + p * tpb;
        token_stride = c->parts * tpb;
    }
    const int64_t *index = part->index + job->start * rpt;
    const uint8_t *skip = scatter && c->skip != NULL ? c->skip + job->start : NULL;
    if (part->run_step != 0 && rpt == 1 && token_stride == tpb) {
        /* A token a row, packed in the payload: rows next to each other in memory too (a
         * block's tokens) go in one memcpy. */
        const int64_t step = part->run_step;
        for (int64_t i = lo; i < hi;) {
            if (skip != NULL && skip[i]) {
                i++;
                continue;
            }
            int64_t k = i + 1;
            while (k < hi && index[k] == index[k - 1] + step && (skip == NULL || !skip[k])) k++;
            char *row = base + index[i] * row_stride, *out = payload + i * rb;
            char *dst = scatter ? row : out, *src = scatter ? out : row;
            if (stream) stream_bytes(dst, src, (k - i) * rb);
            else copy_bytes(dst, src, (k - i) * rb);
            i = k;
        }
        return;
    }
    /* Row j of token t, counted along (a division per row costs as much as its copy). */
    int64_t t = lo / rpt, j = lo - t * rpt;
    char *out = payload + t * token_stride + j * rb;
    for (int64_t i = lo; i < hi;) {
        if (skip != NULL && skip[t]) {
            i += rpt - j;
            j = 0;
            out = payload + ++t * token_stride;
            continue;
        }
        copy_row(base + index[i] * row_stride, out, part, scatter, stream);
        i++;
        out += rb;
        if (++j == rpt) {
            j = 0;
            out = payload + ++t * token_stride;
        }
    }
}

/* Rows [from, to) of the whole copy, counted layer by layer, then part, then job. */
static void run_share(const Copy *c, int64_t from, int64_t to) {
    int64_t offset = 0;
    int64_t first = c->layer < 0 ? 0 : c->layer, last = c->layer < 0 ? c->layers : c->layer + 1;
    for (int64_t l = first; l < last; l++) {
        for (int64_t p = 0; p < c->parts; p++) {
            for (Py_ssize_t j = 0; j < c->jobs; j++) {
                const Job *job = &c->job[j];
                int64_t rows = (job->end - job->start) * c->rpt;
                int64_t lo = from - offset, hi = to - offset;
                offset += rows;
                if (hi <= 0) return;
                if (lo >= rows) continue;
                copy_unit(c, job, p, l, lo < 0 ? 0 : lo, hi < rows ? hi : rows);
            }
        }
    }
}

typedef struct {
    const Copy *copy;
    int64_t from, to;
} Share;

static void *share_main(void *arg) {
    const Share *share = arg;
    run_share(share->copy, share->from, share->to);
    STREAM_FENCE();
    return NULL;
}

/* The copy in `threads` equal shares of rows, the calling thread taking the first; a
 * share whose thread could not start runs here too. Touches no Python object. */
static void run_copy(const Copy *c, int threads) {
    int64_t total = (c->layer < 0 ? c->layers : 1) * c->parts * c->job_rows;
    if (threads <= 1) {
        run_share(c, 0, total);
        STREAM_FENCE();
        return;
    }
    pthread_t ids[MAX_THREADS];
    Share shares[MAX_THREADS];
    int started[MAX_THREADS];
    for (int k = 0; k < threads; k++) {
        shares[k] = (Share){c, total * k / threads, total * (k + 1) / threads};
        started[k] = k > 0 && pthread_create(&ids[k], NULL, share_main, &shares[k]) == 0;
    }
    run_share(c, shares[0].from, shares[0].to);
    for (int k = 1; k < threads; k++) {
        if (started[k]) pthread_join(ids[k], NULL);
        else run_share(c, shares[k].from, shares[k].to);
    }
    STREAM_FENCE();
}

/* -- arguments ------------------------------------------------------------------------------ */

/* The table's `fields` int64 fields (copied out of the caller's buffer, so aligned). */
static int read_table(const char *name, const int64_t *f, Py_ssize_t fields, Copy *c,
                      Part *parts, View *views, int64_t *tokens) {
    if (fields < HEADER_FIELDS) {
        PyErr_Format(PyExc_ValueError, "%s: table has %zd fields, fewer than its header's",
                     name, fields);
        return -1;
    }
    int64_t np = f[0], nl = f[1];
    *tokens = f[2];
    c->rpt = f[3];
    if (np < 1 || np > MAX_PARTS || nl < 1 || nl > 65536 || *tokens < 0 ||
        *tokens > (int64_t)1 << 40 || c->rpt < 1 || c->rpt > 65536) {
        PyErr_Format(PyExc_ValueError,
                     "%s: table header (parts %lld, layers %lld, tokens %lld, rows per token "
                     "%lld) out of range",
                     name, (long long)np, (long long)nl, (long long)*tokens, (long long)c->rpt);
        return -1;
    }
    Py_ssize_t want = HEADER_FIELDS + np * PART_FIELDS + np * nl * VIEW_FIELDS;
    if (fields != want) {
        PyErr_Format(PyExc_ValueError,
                     "%s: table has %zd fields, expected %zd for %lld parts and %lld layers",
                     name, fields, want, (long long)np, (long long)nl);
        return -1;
    }
    c->parts = np;
    c->layers = nl;
    for (int64_t p = 0; p < np; p++) {
        const int64_t *g = f + HEADER_FIELDS + p * PART_FIELDS;
        Part *part = &parts[p];
        int64_t ndims = g[2];
        part->row_bytes = g[0];
        part->seg_bytes = g[1];
        if (part->seg_bytes < 1 || ndims < 0 || ndims > MAX_DIMS) {
            PyErr_Format(PyExc_ValueError, "%s: part %lld: bad row geometry", name, (long long)p);
            return -1;
        }
        int64_t bytes = part->seg_bytes;
        for (int d = 0; d < MAX_DIMS; d++) {
            int used = d >= MAX_DIMS - ndims;
            int64_t n = used ? g[3 + d - (MAX_DIMS - ndims)] : 1;
            int64_t s = used ? g[3 + MAX_DIMS + d - (MAX_DIMS - ndims)] : 0;
            if (n < 1 || n > (int64_t)1 << 32 || s < 0 || s > (int64_t)1 << 40) {
                PyErr_Format(PyExc_ValueError, "%s: part %lld: bad row geometry", name,
                             (long long)p);
                return -1;
            }
            part->count[d] = n;
            part->stride[d] = s;
            if (__builtin_mul_overflow(bytes, n, &bytes)) bytes = -1;
        }
        if (bytes != part->row_bytes || part->row_bytes != parts[0].row_bytes ||
            part->row_bytes > (int64_t)1 << 32) {
            PyErr_Format(PyExc_ValueError,
                         "%s: part %lld: rows of %lld bytes, but its geometry holds %lld "
                         "and part 0's rows %lld",
                         name, (long long)p, (long long)part->row_bytes, (long long)bytes,
                         (long long)parts[0].row_bytes);
            return -1;
        }
        part->rows = INT64_MAX;
        part->run_step = 0;
        for (int64_t l = 0; l < nl; l++) {
            const int64_t *v = f + HEADER_FIELDS + np * PART_FIELDS + (p * nl + l) * VIEW_FIELDS;
            View *view = &views[p * nl + l];
            view->base = (char *)(uintptr_t)v[0];
            view->row_stride = v[2];
            if (v[1] < 0 || v[2] < 0 || (v[0] == 0 && v[1] > 0)) {
                PyErr_Format(PyExc_ValueError, "%s: part %lld, layer %lld: bad view", name,
                             (long long)p, (long long)l);
                return -1;
            }
            if (v[1] < part->rows) part->rows = v[1];
        }
        /* Rows contiguous in memory and in the payload: runs of them go in one memcpy. */
        int64_t stride0 = views[p * nl].row_stride;
        int same = stride0 > 0 && part->row_bytes == part->seg_bytes &&
                   part->row_bytes % stride0 == 0;
        for (int64_t l = 1; same && l < nl; l++) same = views[p * nl + l].row_stride == stride0;
        if (same) part->run_step = part->row_bytes / stride0;
    }
    c->token_part_bytes = parts[0].row_bytes * c->rpt;
    return 0;
}

/* The jobs as (start, end, address, nbytes), each checked against the table. */
static int read_jobs(const char *name, PyObject *seq, Copy *c, Job *jobs, int64_t tokens,
                     int64_t *total_bytes) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int64_t per_token, want;
    if (__builtin_mul_overflow(c->token_part_bytes * c->parts, c->layer < 0 ? c->layers : 1,
                               &per_token)) {
        PyErr_Format(PyExc_ValueError, "%s: the table's token size overflows", name);
        return -1;
    }
    c->job_rows = 0;
    *total_bytes = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *item = items[j];
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 4) {
            PyErr_Format(PyExc_TypeError,
                         "%s: job %zd must be a tuple (start, end, address, nbytes)", name, j);
            return -1;
        }
        long long start = PyLong_AsLongLong(PyTuple_GET_ITEM(item, 0));
        long long end = PyLong_AsLongLong(PyTuple_GET_ITEM(item, 1));
        void *address = PyLong_AsVoidPtr(PyTuple_GET_ITEM(item, 2));
        long long nbytes = PyLong_AsLongLong(PyTuple_GET_ITEM(item, 3));
        if (PyErr_Occurred()) return -1;
        if (start < 0 || end < start || end > tokens) {
            PyErr_Format(PyExc_ValueError, "%s: job %zd: tokens [%lld, %lld) out of [0, %lld)",
                         name, j, start, end, (long long)tokens);
            return -1;
        }
        if (__builtin_mul_overflow(end - start, per_token, &want) ||
            __builtin_add_overflow(*total_bytes, want, total_bytes)) {
            PyErr_Format(PyExc_ValueError, "%s: job %zd: its size overflows", name, j);
            return -1;
        }
        if (nbytes != want || (address == NULL && want > 0)) {
            PyErr_Format(PyExc_ValueError,
                         "%s: job %zd: a payload of %lld bytes at %p, expected %lld bytes for "
                         "tokens [%lld, %lld)",
                         name, j, nbytes, address, (long long)want, start, end);
            return -1;
        }
        jobs[j] = (Job){start, end, address};
        c->job_rows += (end - start) * c->rpt;
    }
    c->job = jobs;
    c->jobs = n;
    return 0;
}

/* Every row number the jobs use is one of its views' rows; a gather reads no skipped
 * token. */
static int check_rows(const char *name, const Copy *c) {
    for (Py_ssize_t j = 0; j < c->jobs; j++) {
        const Job *job = &c->job[j];
        if (!c->scatter && c->skip != NULL) {
            for (int64_t t = job->start; t < job->end; t++) {
                if (c->skip[t]) {
                    PyErr_Format(PyExc_ValueError,
                                 "%s: token %lld has a negative slot: it cannot be gathered",
                                 name, (long long)t);
                    return -1;
                }
            }
        }
        for (int64_t p = 0; p < c->parts; p++) {
            const int64_t *index = c->part[p].index;
            uint64_t rows = (uint64_t)c->part[p].rows;
            for (int64_t i = job->start * c->rpt; i < job->end * c->rpt; i++) {
                if ((uint64_t)index[i] >= rows) {
                    PyErr_Format(PyExc_ValueError,
                                 "%s: part %lld: row %lld of token %lld is out of its views' "
                                 "%lld rows",
                                 name, (long long)p, (long long)index[i],
                                 (long long)(i / c->rpt), (long long)c->part[p].rows);
                    return -1;
                }
            }
        }
    }
    return 0;
}

static PyObject *copy_rows(PyObject *args, int scatter, const char *name) {
    Py_buffer table = {0}, skip = {0}, index[MAX_PARTS];
    PyObject *index_arg, *jobs_arg, *skip_arg, *result = NULL, *jobs_seq = NULL,
                                                *index_seq = NULL;
    long long layer, threads, thread_bytes, stream_bytes;
    Py_ssize_t held = 0;
    Part parts[MAX_PARTS];
    View *views = NULL;
    Job *jobs = NULL;
    int64_t *fields_copy = NULL;
    Copy c = {0};
    int64_t tokens = 0, total = 0;
    char format[32];
    snprintf(format, sizeof format, "y*OOLOLLL:%s", name);
    if (!PyArg_ParseTuple(args, format, &table, &index_arg, &jobs_arg, &layer, &skip_arg,
                          &threads, &thread_bytes, &stream_bytes))
        return NULL;
    c.scatter = scatter;
    c.part = parts;
    if (table.len % (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "%s: table must hold int64 fields, got %zd bytes", name,
                     table.len);
        goto done;
    }
    Py_ssize_t fields = table.len / (Py_ssize_t)sizeof(int64_t);
    fields_copy = PyMem_Malloc((size_t)table.len + sizeof(int64_t));
    views = PyMem_Malloc((size_t)(fields + 1) * sizeof *views);
    if (fields_copy == NULL || views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(fields_copy, table.buf, (size_t)table.len);
    c.view = views;
    if (read_table(name, fields_copy, fields, &c, parts, views, &tokens) < 0) goto done;
    if (threads < 1 || thread_bytes < 1 || stream_bytes < 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s: threads and thread_bytes must be >= 1, stream_bytes >= 0", name);
        goto done;
    }
    if (layer < -1 || layer >= c.layers) {
        PyErr_Format(PyExc_ValueError, "%s: layer %lld out of [-1, %lld)", name, layer,
                     (long long)c.layers);
        goto done;
    }
    c.layer = layer;
    if ((index_seq = PySequence_Fast(index_arg, "index must be a sequence of buffers")) == NULL)
        goto done;
    if (PySequence_Fast_GET_SIZE(index_seq) != c.parts) {
        PyErr_Format(PyExc_ValueError, "%s: %zd index buffers for %lld parts", name,
                     PySequence_Fast_GET_SIZE(index_seq), (long long)c.parts);
        goto done;
    }
    for (; held < c.parts; held++) {
        Py_buffer *b = &index[held];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(index_seq, held), b, PyBUF_SIMPLE) < 0)
            goto done;
        if (b->len != (Py_ssize_t)(tokens * c.rpt * 8) || (uintptr_t)b->buf % 8) {
            PyErr_Format(PyExc_ValueError,
                         "%s: index %zd has %zd bytes, expected %lld aligned int64 row numbers",
                         name, held, b->len, (long long)(tokens * c.rpt));
            held++;
            goto done;
        }
        parts[held].index = b->buf;
    }
    if (skip_arg != Py_None) {
        if (PyObject_GetBuffer(skip_arg, &skip, PyBUF_SIMPLE) < 0) goto done;
        if (skip.len != (Py_ssize_t)tokens) {
            PyErr_Format(PyExc_ValueError, "%s: skip has %zd bytes, expected one per token (%lld)",
                         name, skip.len, (long long)tokens);
            goto done;
        }
        c.skip = skip.buf;
    }
    if ((jobs_seq = PySequence_Fast(jobs_arg, "jobs must be a sequence")) == NULL) goto done;
    if ((jobs = PyMem_Malloc((size_t)(PySequence_Fast_GET_SIZE(jobs_seq) + 1) * sizeof *jobs)) ==
        NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (read_jobs(name, jobs_seq, &c, jobs, tokens, &total) < 0) goto done;
    if (check_rows(name, &c) < 0) goto done;
    long long share = total / thread_bytes;
    int count = (int)(share < threads ? (share < 1 ? 1 : share) : threads);
    if (count > MAX_THREADS) count = MAX_THREADS;
    c.stream = stream_bytes > 0 && total >= stream_bytes;
    if (total >= RELEASE_GIL_BYTES || count > 1) {
        Py_BEGIN_ALLOW_THREADS
        run_copy(&c, count);
        Py_END_ALLOW_THREADS
    } else {
        run_copy(&c, 1);
    }
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&index[i]);
    if (skip.obj != NULL) PyBuffer_Release(&skip);
    PyBuffer_Release(&table);
    Py_XDECREF(index_seq);
    Py_XDECREF(jobs_seq);
    PyMem_Free(fields_copy);
    PyMem_Free(views);
    PyMem_Free(jobs);
    return result;
}

static PyObject *gather_rows(PyObject *module, PyObject *args) {
    (void)module;
    return copy_rows(args, 0, "gather_rows");
}

static PyObject *scatter_rows(PyObject *module, PyObject *args) {
    (void)module;
    return copy_rows(args, 1, "scatter_rows");
}

static PyMethodDef methods[] = {
    {"gather_rows", gather_rows, METH_VARARGS,
     "gather_rows(table, index, jobs, layer, skip, threads, thread_bytes, stream_bytes)\n\n"
     "Copy every job's rows of every part and layer out of the views into its payload."},
    {"scatter_rows", scatter_rows, METH_VARARGS,
     "scatter_rows(table, index, jobs, layer, skip, threads, thread_bytes, stream_bytes)\n\n"
     "Copy every job's payload into its rows of every part and layer; skipped tokens are "
     "not written."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "lmcache_async.transfer._rows",
    "Row copies between paged KV memory and chunk payloads, in C.",
    -1, methods, NULL, NULL, NULL, NULL,
};

/* setup.py defines the digest of the sources this module was compiled from, so a test can
   tell a stale build from a current one. */
#ifndef LMCACHE_ASYNC_SOURCE_HASH
#define LMCACHE_ASYNC_SOURCE_HASH "unknown"
#endif

PyMODINIT_FUNC PyInit__rows(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddStringConstant(m, "SOURCE_HASH", LMCACHE_ASYNC_SOURCE_HASH) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
