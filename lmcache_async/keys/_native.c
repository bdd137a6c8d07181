/* The chain of chunk keys with BLAKE3, in C: lmcache_async.keys._native.blake3_chain; and
 * the CPU tier's walk over a lookup's leading keys (held_prefix_count, held_prefix_values).
 *
 * blake3_chain(seed, data, step, tag) returns tag || h_i for i = 1..n, the pieces p_i =
 * data[(i-1)*step : i*step] (the last one may be short): h_0 = seed (16 bytes), h_i = the
 * first 16 bytes of BLAKE3(p_i || h_{i-1}). The chain links the untagged h_i; the tenant's
 * tag (16 bytes, or none) is put ahead of each. The same keys as keys._chain_blake3_py,
 * which uses the blake3 package: tests hold the two equal.
 *
 * Why C: one BLAKE3 block compression is a chain of ~250 dependent instructions, so hashing
 * one chunk after the other cannot go faster than that chain, whatever the binding. The
 * link h_{i-1} comes last in each input, so every whole 1 KiB BLAKE3 chunk of a piece is
 * hashed without it: those run eight at a time, one per vector lane. Then, in order, each
 * piece's tail and link (one or two short BLAKE3 chunks) and the tree's parent nodes.
 *
 * BLAKE3 as its specification defines it (unkeyed hash, 16-byte output), written for this
 * one use: whole inputs in memory, no incremental state, no extended output.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define CHUNK_LEN 1024
#define BLOCK_LEN 64
#define BLOCKS_PER_CHUNK (CHUNK_LEN / BLOCK_LEN)
/* A link h_i of the chain, and the seed h_0 (keys.digests.LINK_SIZE). */
#define LINK_LEN 16
/* The longest tag put ahead of each link (tenancy.tenants.TAG_BYTES). */
#define TAG_MAX_LEN 16
#define LANES 8
/* Below this many input bytes the GIL is kept: handing it over costs more than the work. */
#define RELEASE_GIL_BYTES 16384

enum { CHUNK_START = 1, CHUNK_END = 2, PARENT = 4, ROOT = 8 };

static const uint32_t IV[8] = {0x6A09E667u, 0xBB67AE85u, 0x3C6EF372u, 0xA54FF53Au,
                               0x510E527Fu, 0x9B05688Cu, 0x1F83D9ABu, 0x5BE0CD19u};

/* The message word each G takes, round by round (the permutation applied r times). */
static const uint8_t SCHEDULE[7][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8},
    {3, 4, 10, 12, 13, 2, 7, 14, 6, 5, 9, 0, 11, 15, 8, 1},
    {10, 7, 12, 9, 14, 3, 13, 15, 4, 0, 11, 2, 5, 8, 1, 6},
    {12, 13, 9, 11, 15, 10, 14, 8, 7, 2, 5, 3, 0, 1, 6, 4},
    {9, 14, 11, 5, 8, 12, 15, 1, 13, 3, 0, 10, 2, 6, 4, 7},
    {11, 15, 5, 0, 1, 9, 8, 6, 14, 10, 2, 12, 3, 4, 7, 13},
};

static inline uint32_t load32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline void store32(uint8_t *p, uint32_t x) {
    p[0] = (uint8_t)x;
    p[1] = (uint8_t)(x >> 8);
    p[2] = (uint8_t)(x >> 16);
    p[3] = (uint8_t)(x >> 24);
}

/* -- one block: the state's four rows in 4-lane vectors ---------------------------------- */

typedef uint32_t v4 __attribute__((vector_size(16)));

#define ROT4(x, n) (((x) >> (n)) | ((x) << (32 - (n))))
#define HALF_ROUND4(mx, my)                     \
    do {                                        \
        r0 += r1 + (mx);                        \
        r3 = ROT4(r3 ^ r0, 16);                 \
        r2 += r3;                               \
        r1 = ROT4(r1 ^ r2, 12);                 \
        r0 += r1 + (my);                        \
        r3 = ROT4(r3 ^ r0, 8);                  \
        r2 += r3;                               \
        r1 = ROT4(r1 ^ r2, 7);                  \
    } while (0)

/* The first 8 words of the compression function's output. */
static void compress(const uint32_t cv[8], const uint8_t block[BLOCK_LEN], uint32_t block_len,
                     uint64_t counter, uint32_t flags, uint32_t out[8]) {
    uint32_t m[16];
    for (int i = 0; i < 16; i++) m[i] = load32(block + 4 * i);
    v4 r0 = {cv[0], cv[1], cv[2], cv[3]};
    v4 r1 = {cv[4], cv[5], cv[6], cv[7]};
    v4 r2 = {IV[0], IV[1], IV[2], IV[3]};
    v4 r3 = {(uint32_t)counter, (uint32_t)(counter >> 32), block_len, flags};
    for (int r = 0; r < 7; r++) {
        const uint8_t *s = SCHEDULE[r];
        /* columns, then diagonals: rotate rows 1..3 so that the diagonals line up */
        HALF_ROUND4(((v4){m[s[0]], m[s[2]], m[s[4]], m[s[6]]}),
                    ((v4){m[s[1]], m[s[3]], m[s[5]], m[s[7]]}));
        r1 = __builtin_shuffle(r1, (v4){1, 2, 3, 0});
        r2 = __builtin_shuffle(r2, (v4){2, 3, 0, 1});
        r3 = __builtin_shuffle(r3, (v4){3, 0, 1, 2});
        HALF_ROUND4(((v4){m[s[8]], m[s[10]], m[s[12]], m[s[14]]}),
                    ((v4){m[s[9]], m[s[11]], m[s[13]], m[s[15]]}));
        r1 = __builtin_shuffle(r1, (v4){3, 0, 1, 2});
        r2 = __builtin_shuffle(r2, (v4){2, 3, 0, 1});
        r3 = __builtin_shuffle(r3, (v4){1, 2, 3, 0});
    }
    r0 ^= r2;
    r1 ^= r3;
    for (int i = 0; i < 4; i++) {
        out[i] = r0[i];
        out[i + 4] = r1[i];
    }
}

/* A BLAKE3 chunk of 1..1024 bytes at chunk index `counter`: its chaining value, or its
 * output when it is the whole input (`root` = ROOT). */
static void chunk_value(const uint8_t *in, size_t len, uint64_t counter, uint32_t root,
                        uint32_t out[8]) {
    uint32_t cv[8];
    uint8_t last[BLOCK_LEN];
    memcpy(cv, IV, sizeof cv);
    uint32_t start = CHUNK_START;
    size_t offset = 0;
    while (len - offset > BLOCK_LEN) {
        compress(cv, in + offset, BLOCK_LEN, counter, start, cv);
        offset += BLOCK_LEN;
        start = 0;
    }
    size_t rest = len - offset;
    memset(last, 0, sizeof last);
    memcpy(last, in + offset, rest);
    compress(cv, last, (uint32_t)rest, counter, start | CHUNK_END | root, out);
}

static void parent_value(const uint32_t left[8], const uint32_t right[8], uint32_t root,
                         uint32_t out[8]) {
    uint8_t block[BLOCK_LEN];
    for (int i = 0; i < 8; i++) {
        store32(block + 4 * i, left[i]);
        store32(block + 32 + 4 * i, right[i]);
    }
    compress(IV, block, BLOCK_LEN, 0, PARENT | root, out);
}

/* The value of the tree over `n` >= 1 chunk values: its left subtree holds the largest
 * power of two of chunks that leaves at least one for the right. */
static void tree_value(const uint32_t (*values)[8], size_t n, uint32_t root, uint32_t out[8]) {
    if (n == 1) {
        memcpy(out, values[0], 8 * sizeof(uint32_t));
        return;
    }
    size_t left = 1;
    while (left * 2 < n) left *= 2;
    uint32_t l[8], r[8];
    tree_value(values, left, 0, l);
    tree_value(values + left, n - left, 0, r);
    parent_value(l, r, root, out);
}

/* -- eight whole chunks at once, one per lane --------------------------------------------- */

typedef uint32_t v8 __attribute__((vector_size(32)));

#define ROT8(x, n) (((x) >> (n)) | ((x) << (32 - (n))))
#define G8(a, b, c, d, x, y)               \
    do {                                   \
        v[a] += v[b] + (x);                \
        v[d] = ROT8(v[d] ^ v[a], 16);      \
        v[c] += v[d];                      \
        v[b] = ROT8(v[b] ^ v[c], 12);      \
        v[a] += v[b] + (y);                \
        v[d] = ROT8(v[d] ^ v[a], 8);       \
        v[c] += v[d];                      \
        v[b] = ROT8(v[b] ^ v[c], 7);       \
    } while (0)

#if defined(__x86_64__) && defined(__linux__)
/* AVX2 where the CPU has it (chosen once, at load), else plain SSE2. */
#define MULTI_VERSIONED __attribute__((target_clones("avx2", "default")))
#else
#define MULTI_VERSIONED
#endif

/* The chaining values of eight whole (1024-byte, non-final) chunks `in[k]` at chunk index
 * `counter[k]`. */
MULTI_VERSIONED
static void eight_chunk_values(const uint8_t *const in[LANES], const uint64_t counter[LANES],
                               uint32_t out[LANES][8]) {
    v8 cv[8], m[16], v[16], low = {0}, high = {0};
    for (int i = 0; i < 8; i++) cv[i] = (v8){0} + IV[i];
    for (int k = 0; k < LANES; k++) {
        low[k] = (uint32_t)counter[k];
        high[k] = (uint32_t)(counter[k] >> 32);
    }
    for (int b = 0; b < BLOCKS_PER_CHUNK; b++) {
        for (int w = 0; w < 16; w++) {
            for (int k = 0; k < LANES; k++) m[w][k] = load32(in[k] + b * BLOCK_LEN + 4 * w);
        }
        uint32_t flags = (b == 0 ? CHUNK_START : 0) | (b == BLOCKS_PER_CHUNK - 1 ? CHUNK_END : 0);
        for (int i = 0; i < 8; i++) v[i] = cv[i];
        for (int i = 0; i < 4; i++) v[8 + i] = (v8){0} + IV[i];
        v[12] = low;
        v[13] = high;
        v[14] = (v8){0} + (uint32_t)BLOCK_LEN;
        v[15] = (v8){0} + flags;
        for (int r = 0; r < 7; r++) {
            const uint8_t *s = SCHEDULE[r];
            G8(0, 4, 8, 12, m[s[0]], m[s[1]]);
            G8(1, 5, 9, 13, m[s[2]], m[s[3]]);
            G8(2, 6, 10, 14, m[s[4]], m[s[5]]);
            G8(3, 7, 11, 15, m[s[6]], m[s[7]]);
            G8(0, 5, 10, 15, m[s[8]], m[s[9]]);
            G8(1, 6, 11, 12, m[s[10]], m[s[11]]);
            G8(2, 7, 8, 13, m[s[12]], m[s[13]]);
            G8(3, 4, 9, 14, m[s[14]], m[s[15]]);
        }
        for (int i = 0; i < 8; i++) cv[i] = v[i] ^ v[i + 8];
    }
    for (int k = 0; k < LANES; k++) {
        for (int i = 0; i < 8; i++) out[k][i] = cv[i][k];
    }
}

/* -- the chain ----------------------------------------------------------------------------- */

static size_t piece_len(size_t total, size_t step, size_t i) {
    size_t start = i * step;
    return total - start < step ? total - start : step;
}

/* Write the link of each piece of `data` at `digests + i * stride + offset` (stride >=
 * offset + 16: the room before each link is the tag's). `values` has room for every whole
 * chunk of every piece, plus two and a lane group. Touches no Python object. */
static void run_chain(const uint8_t *seed, const uint8_t *data, size_t total, size_t step,
                      size_t n, uint32_t (*values)[8], uint8_t *digests, size_t stride,
                      size_t offset) {
    /* 1. Every whole BLAKE3 chunk of every piece: none depends on a link. */
    const uint8_t *in[LANES];
    uint64_t counter[LANES];
    uint32_t lane_out[LANES][8];
    size_t done = 0, filled = 0;
    for (size_t i = 0; i < n; i++) {
        size_t whole = piece_len(total, step, i) / CHUNK_LEN;
        for (size_t c = 0; c < whole; c++) {
            in[filled] = data + i * step + c * CHUNK_LEN;
            counter[filled] = c;
            if (++filled == LANES) {
                eight_chunk_values(in, counter, lane_out);
                memcpy(values[done], lane_out, sizeof lane_out);
                done += LANES;
                filled = 0;
            }
        }
    }
    if (filled) {
        for (size_t k = filled; k < LANES; k++) {
            in[k] = in[0];
            counter[k] = counter[0];
        }
        eight_chunk_values(in, counter, lane_out);
        memcpy(values[done], lane_out, filled * sizeof lane_out[0]);
    }
    /* 2. In order: each piece's tail with the link, then its tree. */
    uint8_t link[LINK_LEN], tail[CHUNK_LEN + LINK_LEN];
    uint32_t out[8], spare[2][8];
    memcpy(link, seed, LINK_LEN);
    size_t first = 0;
    for (size_t i = 0; i < n; i++) {
        size_t len = piece_len(total, step, i);
        size_t whole = len / CHUNK_LEN, rest = len % CHUNK_LEN, tail_len = rest + LINK_LEN;
        memcpy(tail, data + i * step + whole * CHUNK_LEN, rest);
        memcpy(tail + rest, link, LINK_LEN);
        if (whole == 0 && tail_len <= CHUNK_LEN) {
            chunk_value(tail, tail_len, 0, ROOT, out);
        } else {
            /* The tail's values go after this piece's whole chunks, over the next piece's
             * first ones: keep those aside meanwhile. */
            uint32_t(*mine)[8] = values + first;
            memcpy(spare, mine + whole, sizeof spare);
            size_t count = whole;
            if (tail_len <= CHUNK_LEN) {
                chunk_value(tail, tail_len, whole, 0, mine[count++]);
            } else {
                chunk_value(tail, CHUNK_LEN, whole, 0, mine[count++]);
                chunk_value(tail + CHUNK_LEN, tail_len - CHUNK_LEN, whole + 1, 0, mine[count++]);
            }
            tree_value((const uint32_t(*)[8])mine, count, ROOT, out);
            memcpy(mine + whole, spare, sizeof spare);
        }
        for (int w = 0; w < LINK_LEN / 4; w++) store32(link + 4 * w, out[w]);
        memcpy(digests + i * stride + offset, link, LINK_LEN);
        first += whole;
    }
}

static PyObject *blake3_chain(PyObject *module, PyObject *args) {
    (void)module;
    Py_buffer seed, data, tag = {0};
    Py_ssize_t step;
    if (!PyArg_ParseTuple(args, "y*y*n|y*:blake3_chain", &seed, &data, &step, &tag))
        return NULL;
    PyObject *result = NULL;
    uint8_t *digests = NULL;
    uint32_t(*values)[8] = NULL;
    if (seed.len != LINK_LEN) {
        PyErr_Format(PyExc_ValueError, "seed must be %d bytes, got %zd", LINK_LEN, seed.len);
        goto done;
    }
    if (step <= 0) {
        PyErr_Format(PyExc_ValueError, "step must be positive, got %zd", step);
        goto done;
    }
    if (tag.len > TAG_MAX_LEN) {
        PyErr_Format(PyExc_ValueError, "tag must be at most %d bytes, got %zd", TAG_MAX_LEN,
                     tag.len);
        goto done;
    }
    size_t total = (size_t)data.len, n = (total + (size_t)step - 1) / (size_t)step;
    size_t whole = 0;
    for (size_t i = 0; i < n; i++) whole += piece_len(total, (size_t)step, i) / CHUNK_LEN;
    size_t tag_len = (size_t)tag.len, stride = tag_len + LINK_LEN;
    digests = PyMem_Malloc(n * stride + 1);
    values = PyMem_Calloc(whole + 2 + LANES, sizeof *values);
    if (digests == NULL || values == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (total >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        run_chain(seed.buf, data.buf, total, (size_t)step, n, values, digests, stride, tag_len);
        Py_END_ALLOW_THREADS
    } else {
        run_chain(seed.buf, data.buf, total, (size_t)step, n, values, digests, stride, tag_len);
    }
    /* The keys: the tag, then the link (the chain linked the untagged links). */
    for (size_t i = 0; tag_len > 0 && i < n; i++) memcpy(digests + i * stride, tag.buf, tag_len);
    result = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; result != NULL && i < n; i++) {
        PyObject *digest = PyBytes_FromStringAndSize((const char *)digests + i * stride,
                                                     (Py_ssize_t)stride);
        if (digest == NULL) {
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, (Py_ssize_t)i, digest);
    }
done:
    PyMem_Free(digests);
    PyMem_Free(values);
    PyBuffer_Release(&seed);
    PyBuffer_Release(&data);
    if (tag.obj != NULL) PyBuffer_Release(&tag);
    return result;
}

/* The leading keys of `keys` that `index` (an OrderedDict) holds, each moved to its end,
 * the newest: the walk of an LRU tier's lookup. Returns their count, or with `values` a
 * list of the values they map to. */
static PyObject *held_prefix(PyObject *const *args, Py_ssize_t nargs, int values,
                             const char *name) {
    static PyObject *move_to_end = NULL;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s takes 2 arguments, got %zd", name, nargs);
        return NULL;
    }
    PyObject *index = args[0];
    if (!PyDict_Check(index)) {
        PyErr_Format(PyExc_TypeError, "%s: index must be an OrderedDict, got %s", name,
                     Py_TYPE(index)->tp_name);
        return NULL;
    }
    if (move_to_end == NULL && (move_to_end = PyUnicode_InternFromString("move_to_end")) == NULL)
        return NULL;
    PyObject *keys = PySequence_Fast(args[1], "keys must be a sequence");
    if (keys == NULL) return NULL;
    PyObject *out = values ? PyList_New(0) : NULL, *move = NULL;
    Py_ssize_t count = 0, total = PySequence_Fast_GET_SIZE(keys);
    PyObject **items = PySequence_Fast_ITEMS(keys);
    if (values && out == NULL) goto fail;
    for (; count < total; count++) {
        PyObject *key = items[count];
        /* A borrowed value, kept alive across move_to_end (which may run Python code). */
        PyObject *value = PyDict_GetItemWithError(index, key);
        if (value == NULL) {
            if (PyErr_Occurred()) goto fail;
            break;
        }
        /* The bound method, looked up at the first hit only. */
        if (move == NULL && (move = PyObject_GetAttr(index, move_to_end)) == NULL) goto fail;
        Py_INCREF(value);
        PyObject *moved = PyObject_CallOneArg(move, key);
        if (moved == NULL || (values && PyList_Append(out, value) < 0)) {
            Py_XDECREF(moved);
            Py_DECREF(value);
            goto fail;
        }
        Py_DECREF(moved);
        Py_DECREF(value);
    }
    Py_XDECREF(move);
    Py_DECREF(keys);
    return values ? out : PyLong_FromSsize_t(count);
fail:
    Py_XDECREF(move);
    Py_DECREF(keys);
    Py_XDECREF(out);
    return NULL;
}

static PyObject *held_prefix_count(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    return held_prefix(args, nargs, 0, "held_prefix_count");
}

static PyObject *held_prefix_values(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    return held_prefix(args, nargs, 1, "held_prefix_values");
}

static PyMethodDef methods[] = {
    {"blake3_chain", blake3_chain, METH_VARARGS,
     "blake3_chain(seed, data, step, tag=b'') -> list[bytes]\n\n"
     "h_i = BLAKE3(data[(i-1)*step : i*step] || h_{i-1})[:16], h_0 = seed (16 bytes);\n"
     "each returned as tag || h_i (tag: at most 16 bytes)."},
    {"held_prefix_count", (PyCFunction)(void (*)(void))held_prefix_count, METH_FASTCALL,
     "held_prefix_count(index, keys) -> int\n\n"
     "How many leading keys the OrderedDict index holds; each is moved to its end."},
    {"held_prefix_values", (PyCFunction)(void (*)(void))held_prefix_values, METH_FASTCALL,
     "held_prefix_values(index, keys) -> list\n\n"
     "The values of the leading keys the OrderedDict index holds; each is moved to its end."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "lmcache_async.keys._native",
    "The chain of chunk keys with BLAKE3, and the CPU tier's prefix walk, in C.",
    -1, methods, NULL, NULL, NULL, NULL,
};

/* setup.py defines the digest of the sources this module was compiled from, so a test can
   tell a stale build from a current one. */
#ifndef LMCACHE_ASYNC_SOURCE_HASH
#define LMCACHE_ASYNC_SOURCE_HASH "unknown"
#endif

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddStringConstant(m, "SOURCE_HASH", LMCACHE_ASYNC_SOURCE_HASH) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
