/* The compiled block-id hash: `stable_hashes63` of btb_lab/workload/hashing.py without a
 * hashlib object, a digest bytes object and an int.from_bytes call per id; and the loader's
 * two per-id loops (`interned`, `rows_of_ids`, used by btb_lab/workload/columnar.py).
 *
 * BLAKE2b with an 8-byte digest and no key, as RFC 7693 defines it (the same function as
 * hashlib.blake2b(data, digest_size=8)); the digest read big-endian and masked to 63 bits,
 * exactly as the Python code does. tests/unit/test_workload_hashing.py checks both paths
 * against hashlib on empty, short, multi-block and non-ASCII texts.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t SIGMA[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
}; /* rounds 10 and 11 use rows 0 and 1 again */

#define ROTR64(x, n) (((x) >> (n)) | ((x) << (64 - (n))))
#define MIX(a, b, c, d, x, y)          \
    do {                               \
        v[a] = v[a] + v[b] + (x);      \
        v[d] = ROTR64(v[d] ^ v[a], 32); \
        v[c] = v[c] + v[d];            \
        v[b] = ROTR64(v[b] ^ v[c], 24); \
        v[a] = v[a] + v[b] + (y);      \
        v[d] = ROTR64(v[d] ^ v[a], 16); \
        v[c] = v[c] + v[d];            \
        v[b] = ROTR64(v[b] ^ v[c], 63); \
    } while (0)

static uint64_t load64_le(const uint8_t *p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t w;
    memcpy(&w, p, sizeof w);
    return w;
#else
    uint64_t w = 0;
    for (int i = 7; i >= 0; i--) w = (w << 8) | p[i];
    return w;
#endif
}

/* One compression of the 128-byte `block`; `bytes` counts the message bytes so far. */
static void compress(uint64_t h[8], const uint8_t block[128], uint64_t bytes, int last) {
    uint64_t v[16], m[16];
    for (int i = 0; i < 16; i++) m[i] = load64_le(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= bytes; /* the high word of the 128-bit counter stays 0 below 2**64 bytes */
    if (last) v[14] = ~v[14];
    /* the rounds written out, so every message index is a constant (m stays in registers) */
#define ROUND(r)                                                           \
    do {                                                                   \
        MIX(0, 4, 8, 12, m[SIGMA[(r) % 10][0]], m[SIGMA[(r) % 10][1]]);    \
        MIX(1, 5, 9, 13, m[SIGMA[(r) % 10][2]], m[SIGMA[(r) % 10][3]]);    \
        MIX(2, 6, 10, 14, m[SIGMA[(r) % 10][4]], m[SIGMA[(r) % 10][5]]);   \
        MIX(3, 7, 11, 15, m[SIGMA[(r) % 10][6]], m[SIGMA[(r) % 10][7]]);   \
        MIX(0, 5, 10, 15, m[SIGMA[(r) % 10][8]], m[SIGMA[(r) % 10][9]]);   \
        MIX(1, 6, 11, 12, m[SIGMA[(r) % 10][10]], m[SIGMA[(r) % 10][11]]); \
        MIX(2, 7, 8, 13, m[SIGMA[(r) % 10][12]], m[SIGMA[(r) % 10][13]]);  \
        MIX(3, 4, 9, 14, m[SIGMA[(r) % 10][14]], m[SIGMA[(r) % 10][15]]);  \
    } while (0)
    ROUND(0);
    ROUND(1);
    ROUND(2);
    ROUND(3);
    ROUND(4);
    ROUND(5);
    ROUND(6);
    ROUND(7);
    ROUND(8);
    ROUND(9);
    ROUND(10);
    ROUND(11);
#undef ROUND
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* BLAKE2b-64 of `data`, read big-endian as hashlib's digest would be, masked to 63 bits. */
static uint64_t hash63(const uint8_t *data, Py_ssize_t n) {
    uint64_t h[8];
    uint8_t block[128];
    memcpy(h, IV, sizeof h);
    h[0] ^= 0x01010000ULL ^ 8; /* fanout 1, depth 1, no key, 8-byte digest */
    uint64_t done = 0;
    while (n > 128) {
        done += 128;
        compress(h, data, done, 0);
        data += 128;
        n -= 128;
    }
    memset(block, 0, sizeof block);
    memcpy(block, data, (size_t)n);
    compress(h, block, done + (uint64_t)n, 1);
    /* digest bytes are h[0] little-endian; int.from_bytes(..., "big") reverses them */
    uint64_t x = h[0], be = 0;
    for (int i = 0; i < 8; i++) {
        be = (be << 8) | (x & 0xff);
        x >>= 8;
    }
    return be & 0x7fffffffffffffffULL;
}

static PyObject *stable_hashes63(PyObject *self, PyObject *texts) {
    PyObject *seq = PySequence_Fast(texts, "stable_hashes63 takes a sequence of str");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyUnicode_Check(items[i])) {
            PyErr_Format(PyExc_TypeError, "stable_hashes63: expected str, got %.100s",
                         Py_TYPE(items[i])->tp_name);
            goto fail;
        }
        Py_ssize_t size;
        const char *utf8 = PyUnicode_AsUTF8AndSize(items[i], &size);
        if (utf8 == NULL) goto fail; /* a lone surrogate: str.encode() raises too */
        PyObject *value = PyLong_FromUnsignedLongLong(hash63((const uint8_t *)utf8, size));
        if (value == NULL) goto fail;
        PyList_SET_ITEM(out, i, value);
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(seq);
    Py_DECREF(out);
    return NULL;
}

/* interned(table, values) -> list: table.setdefault(v, v) for each of `values` (a list),
 * without a method call per value: each distinct id of a file becomes one object. */
static PyObject *interned(PyObject *self, PyObject *args) {
    PyObject *table, *values;
    if (!PyArg_ParseTuple(args, "O!O!:interned", &PyDict_Type, &table, &PyList_Type, &values))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(values);
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *value = PyList_GET_ITEM(values, i);
        PyObject *kept = PyDict_SetDefault(table, value, value); /* borrowed */
        if (kept == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        Py_INCREF(kept);
        PyList_SET_ITEM(out, i, kept);
    }
    return out;
}

/* An int array's buffer: 8-byte items, or 4-byte ones where `narrow_ok` (Arrow's
 * dictionary indices are int32; widening them would copy 8 bytes per block occurrence). */
static int int_buffer(PyObject *obj, Py_buffer *view, const char *name, int narrow_ok) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    int wide = view->itemsize == 8 && (strcmp(f, "q") == 0 || strcmp(f, "l") == 0);
    int narrow = narrow_ok && view->itemsize == 4 && strcmp(f, "i") == 0;
    if (!wide && !narrow) {
        PyErr_Format(PyExc_TypeError, "rows_of_ids: %s must be a contiguous %s array", name,
                     narrow_ok ? "int32 or int64" : "int64");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* rows_of_ids(ids, indices, bounds) -> list[tuple]: row r is the tuple of ids[indices[k]]
 * for k in bounds[r]..bounds[r+1]: a batch's rows of block ids, every occurrence of an id
 * the one object in `ids`, without a flat tuple, a slice per row and a numpy object array
 * in between. `indices` is an int32 or int64 array, `bounds` an int64 one; both are
 * checked. */
static PyObject *rows_of_ids(PyObject *self, PyObject *args) {
    PyObject *ids, *indices_obj, *bounds_obj;
    if (!PyArg_ParseTuple(args, "O!OO:rows_of_ids", &PyList_Type, &ids, &indices_obj,
                          &bounds_obj))
        return NULL;
    Py_buffer iv, bv;
    if (int_buffer(indices_obj, &iv, "indices", 1) < 0) return NULL;
    if (int_buffer(bounds_obj, &bv, "bounds", 0) < 0) {
        PyBuffer_Release(&iv);
        return NULL;
    }
    const int64_t *wide = iv.itemsize == 8 ? (const int64_t *)iv.buf : NULL;
    const int32_t *narrow = (const int32_t *)iv.buf;
#define INDEX(k) (wide ? wide[k] : (int64_t)narrow[k])
    const int64_t *bound = (const int64_t *)bv.buf;
    Py_ssize_t n_ids = PyList_GET_SIZE(ids), n_index = iv.len / iv.itemsize, n_bounds = bv.len / 8;
    Py_ssize_t rows = n_bounds > 0 ? n_bounds - 1 : 0;
    PyObject *out = NULL;
    for (Py_ssize_t r = 0; r < n_bounds; r++) {
        if (bound[r] < 0 || bound[r] > n_index || (r > 0 && bound[r] < bound[r - 1])) {
            PyErr_SetString(PyExc_ValueError, "rows_of_ids: bounds out of order or range");
            goto done;
        }
    }
    for (Py_ssize_t k = 0; k < n_index; k++) {
        if (INDEX(k) < 0 || INDEX(k) >= n_ids) {
            PyErr_SetString(PyExc_ValueError, "rows_of_ids: an index out of range");
            goto done;
        }
    }
    out = PyList_New(rows);
    if (out == NULL) goto done;
    for (Py_ssize_t r = 0; r < rows; r++) {
        Py_ssize_t start = (Py_ssize_t)bound[r], size = (Py_ssize_t)(bound[r + 1] - bound[r]);
        PyObject *row = PyTuple_New(size);
        if (row == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        for (Py_ssize_t k = 0; k < size; k++) {
            PyObject *id = PyList_GET_ITEM(ids, (Py_ssize_t)INDEX(start + k));
            Py_INCREF(id);
            PyTuple_SET_ITEM(row, k, id);
        }
        PyList_SET_ITEM(out, r, row);
    }
#undef INDEX
done:
    PyBuffer_Release(&iv);
    PyBuffer_Release(&bv);
    return out;
}

static PyMethodDef methods[] = {
    {"stable_hashes63", stable_hashes63, METH_O,
     "stable_hashes63(texts) -> list[int]: the 63-bit blake2b id of each str."},
    {"interned", interned, METH_VARARGS,
     "interned(table, values) -> list: table.setdefault(v, v) for each value."},
    {"rows_of_ids", rows_of_ids, METH_VARARGS,
     "rows_of_ids(ids, indices, bounds) -> list[tuple]: each row's ids by index (int32/int64 arrays)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_hashc", "The compiled block-id hash (BLAKE2b, RFC 7693) and the loader's id loops.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__hashc(void) { return PyModule_Create(&module); }
