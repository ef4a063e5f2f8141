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


/* ---- IdScanner: the `hash_ids` arrays of a JSONL chunk, read without pyarrow ----------
 *
 * pyarrow's JSON reader spends most of a long-prefix trace's load building a list<string>
 * column of every block id occurrence, which the loader then dictionary-encodes, hashes
 * per distinct id and turns into tuples. The scanner reads each line's top-level
 * `hash_ids` array itself: every distinct token (the bytes of a string id, or the value
 * of an integer id) is kept once in a table with its converted id object, so an
 * occurrence costs one table lookup. It reads a strict subset of JSON: anything else (an
 * escape or non-ASCII byte in a string id, a number that is not a plain int64, a null,
 * a key written with an escape, a second `hash_ids`, an id of the other kind, a line
 * without the key) makes `scan` return None, and the caller parses that chunk as before.
 * The rest of each line is skipped, not checked: pyarrow parses every line too (without
 * the ids) and refuses what is not JSON.
 *
 * `scan` tokenizes without the interpreter lock (the table belongs to one scanner, used
 * by one thread at a time), then converts new tokens and builds the tuples with it. */

typedef struct {
    uint64_t hash;
    size_t offset; /* the token's bytes in the arena */
    size_t length;
    PyObject *value; /* NULL until converted */
} Entry;

typedef struct {
    PyObject_HEAD
    int strings;          /* 1: string ids (hashed), 0: integer ids */
    PyObject *interned;   /* dict: id value -> its one object, shared with the other path */
    uint32_t *slots;      /* open addressing: entry number + 1, 0 = empty */
    size_t mask;
    Entry *entries;
    size_t n_entries, cap_entries, converted;
    char *arena;
    size_t arena_len, arena_cap;
    int busy;
} IdScanner;

static uint64_t token_hash(const char *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ULL ^ n;
    for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)p[i]) * 0x100000001b3ULL;
    h ^= h >> 32;
    h *= 0x9e3779b97f4a7c15ULL;
    return h ^ (h >> 29);
}

/* `n` bytes appended to a growing buffer (doubling from 64 KiB); -1 when out of memory. */
static int append_bytes(char **buf, size_t *len, size_t *cap, const char *p, size_t n) {
    if (*len + n > *cap) {
        size_t grown = *cap ? *cap : 1 << 16;
        while (grown < *len + n) grown *= 2;
        char *bigger = realloc(*buf, grown);
        if (bigger == NULL) return -1;
        *buf = bigger;
        *cap = grown;
    }
    memcpy(*buf + *len, p, n);
    *len += n;
    return 0;
}

static int scanner_grow_slots(IdScanner *s) {
    size_t size = s->slots ? (s->mask + 1) * 2 : 1024;
    uint32_t *slots = calloc(size, sizeof *slots);
    if (slots == NULL) return -1;
    for (size_t e = 0; e < s->n_entries; e++) {
        size_t i = s->entries[e].hash & (size - 1);
        while (slots[i]) i = (i + 1) & (size - 1);
        slots[i] = (uint32_t)(e + 1);
    }
    free(s->slots);
    s->slots = slots;
    s->mask = size - 1;
    return 0;
}

/* The entry number of a token, added if new; -1 when out of memory. No interpreter calls. */
static int64_t scanner_entry(IdScanner *s, const char *p, size_t n) {
    if ((s->n_entries + 1) * 2 > s->mask + 1 && scanner_grow_slots(s) < 0) return -1;
    uint64_t hash = token_hash(p, n);
    size_t i = hash & s->mask;
    for (uint32_t slot; (slot = s->slots[i]) != 0; i = (i + 1) & s->mask) {
        const Entry *entry = &s->entries[slot - 1];
        if (entry->hash == hash && entry->length == n) {
            const char *kept = s->arena + entry->offset;
            size_t k = 0;
            while (k < n && kept[k] == p[k]) k++;
            if (k == n) return slot - 1;
        }
    }
    if (s->n_entries == s->cap_entries) {
        size_t cap = s->cap_entries ? s->cap_entries * 2 : 1024;
        if (cap > UINT32_MAX - 1) return -1;
        Entry *entries = realloc(s->entries, cap * sizeof *entries);
        if (entries == NULL) return -1;
        s->entries = entries;
        s->cap_entries = cap;
    }
    size_t offset = s->arena_len;
    if (append_bytes(&s->arena, &s->arena_len, &s->arena_cap, p, n) < 0) return -1;
    s->entries[s->n_entries] = (Entry){hash, offset, n, NULL};
    s->slots[i] = (uint32_t)(s->n_entries + 1);
    return (int64_t)s->n_entries++;
}

/* Growable arrays of the tokenizer's output, and the last lines' arrays: a line usually
 * begins with the ids of a recent line (a burst's shared prefix, a session's earlier
 * turns), whose tokens are then taken from that line by one byte comparison instead of
 * a table lookup each. */
#define RECENT 16

typedef struct {
    const char *array; /* its '[' in the chunk */
    size_t bytes;      /* up to and including its ']' */
    size_t first;      /* its first token in ids / ends */
    size_t count;
} Recent;

typedef struct {
    uint32_t *ids;    /* entry numbers, all lines */
    uint32_t *ends;   /* each token's end (the byte after it) from its array's '[' */
    size_t n_ids, cap_ids;
    size_t *counts;   /* ids per line */
    size_t n_lines, cap_lines;
    Recent recent[RECENT];
    size_t n_recent, next_recent;
    char *text;       /* each line again, its array written as `null` */
    size_t text_len, text_cap;
} Scanned;

static int push_text(Scanned *o, const char *p, size_t n) {
    return append_bytes(&o->text, &o->text_len, &o->text_cap, p, n);
}

static int push_id(Scanned *o, uint32_t id, size_t end) {
    if (end > UINT32_MAX) return -1;
    if (o->n_ids == o->cap_ids) {
        size_t cap = o->cap_ids ? o->cap_ids * 2 : 1 << 16;
        uint32_t *ids = realloc(o->ids, cap * sizeof *ids);
        if (ids == NULL) return -1;
        o->ids = ids;
        uint32_t *ends = realloc(o->ends, cap * sizeof *ends);
        if (ends == NULL) return -1;
        o->ends = ends;
        o->cap_ids = cap;
    }
    o->ends[o->n_ids] = (uint32_t)end;
    o->ids[o->n_ids++] = id;
    return 0;
}

static int push_line(Scanned *o, size_t count) {
    if (o->n_lines == o->cap_lines) {
        size_t cap = o->cap_lines ? o->cap_lines * 2 : 1024;
        size_t *counts = realloc(o->counts, cap * sizeof *counts);
        if (counts == NULL) return -1;
        o->counts = counts;
        o->cap_lines = cap;
    }
    o->counts[o->n_lines++] = count;
    return 0;
}

static size_t common_prefix(const char *a, const char *b, size_t n) {
    size_t i = 0;
    for (uint64_t x, y; i + 8 <= n; i += 8) {
        memcpy(&x, a + i, 8);
        memcpy(&y, b + i, 8);
        if (x != y) break;
    }
    while (i < n && a[i] == b[i]) i++;
    return i;
}

/* The recent array sharing the most whole tokens with the one at `array` (its bytes up to
 * `end`): how many tokens (0: none) and which (*which). A token is shared when its bytes
 * and the byte after it (a delimiter) are the same at the same offset. */
static size_t shared_tokens(const Scanned *o, const char *array, const char *end,
                            size_t *which) {
    size_t best = 0;
    for (size_t r = 0; r < o->n_recent; r++) {
        const Recent *line = &o->recent[r];
        size_t limit = line->bytes < (size_t)(end - array) ? line->bytes : (size_t)(end - array);
        size_t same = common_prefix(array, line->array, limit);
        const uint32_t *ends = o->ends + line->first;
        size_t lo = 0, hi = line->count; /* tokens with ends[k] < same */
        while (lo < hi) {
            size_t mid = (lo + hi) / 2;
            if (ends[mid] < same) lo = mid + 1; else hi = mid;
        }
        if (lo > best) {
            best = lo;
            *which = r;
        }
    }
    return best;
}

static void remember(Scanned *o, const char *array, size_t bytes, size_t first, size_t count,
                     size_t shared, size_t which) {
    size_t slot; /* a line that extends a recent one takes its place */
    if (shared > 0) {
        slot = which;
    } else if (o->n_recent < RECENT) {
        slot = o->n_recent++;
    } else {
        slot = o->next_recent;
        o->next_recent = (o->next_recent + 1) % RECENT;
    }
    o->recent[slot] = (Recent){array, bytes, first, count};
}

enum { SCAN_OK = 0, SCAN_OTHER = 1, SCAN_NOMEM = 2 };

static const char *skip_spaces(const char *p, const char *end) {
    while (p < end && *p == ' ') p++;
    return p;
}

/* After a string's opening quote: past its closing quote, or NULL. */
static const char *skip_string(const char *p, const char *end) {
    while (p < end) {
        char c = *p++;
        if (c == '"') return p;
        if (c == '\\') {
            if (p == end) return NULL;
            p++;
        }
    }
    return NULL;
}

/* Past one JSON value, or NULL. Not a validator: pyarrow checks the line. */
static const char *skip_value(const char *p, const char *end) {
    if (p == end) return NULL;
    if (*p == '"') return skip_string(p + 1, end);
    if (*p == '{' || *p == '[') {
        int depth = 0;
        while (p < end) {
            char c = *p++;
            if (c == '"') {
                if ((p = skip_string(p, end)) == NULL) return NULL;
            } else if (c == '{' || c == '[') {
                depth++;
            } else if (c == '}' || c == ']') {
                if (--depth == 0) return p;
            }
        }
        return NULL;
    }
    const char *start = p;
    while (p < end && *p != ',' && *p != '}' && *p != ']' && *p != ' ') p++;
    return p > start ? p : NULL;
}

/* One `hash_ids` array at p (its '['); past its ']' via *next. */
static int scan_array(IdScanner *s, const char *p, const char *end, Scanned *o, size_t *count,
                      const char **next) {
    if (p == end || *p != '[') return SCAN_OTHER;
    const char *array = p;
    size_t first = o->n_ids, which = 0, shared = shared_tokens(o, array, end, &which);
    if (shared > 0) { /* the recent line's first `shared` tokens, then on from the last */
        const Recent *line = &o->recent[which];
        for (size_t k = 0; k < shared; k++)
            if (push_id(o, o->ids[line->first + k], o->ends[line->first + k]) < 0)
                return SCAN_NOMEM;
        *count = shared;
        p = array + o->ends[o->n_ids - 1];
    } else {
        p = skip_spaces(p + 1, end);
        if (p < end && *p == ']') {
            *next = p + 1;
            return SCAN_OK;
        }
    }
    while (1) {
        if (*count > 0 || shared > 0) { /* after a token: a delimiter */
            p = skip_spaces(p, end);
            if (p == end) return SCAN_OTHER;
            if (*p == ']') {
                *next = p + 1;
                remember(o, array, (size_t)(p + 1 - array), first, *count, shared, which);
                return SCAN_OK;
            }
            if (*p != ',') return SCAN_OTHER;
            p = skip_spaces(p + 1, end);
        }
        const char *token;
        size_t n;
        int64_t value = 0;
        if (s->strings) {
            if (p == end || *p != '"') return SCAN_OTHER;
            token = ++p;
            while (p < end && *p != '"') {
                if (*p == '\\' || (uint8_t)*p >= 0x80) return SCAN_OTHER;
                p++;
            }
            if (p == end) return SCAN_OTHER;
            n = (size_t)(p - token);
            p++;
        } else {
            int negative = p < end && *p == '-';
            if (negative) p++;
            const char *digits = p;
            uint64_t magnitude = 0;
            while (p < end && *p >= '0' && *p <= '9' && p - digits < 20) {
                magnitude = magnitude * 10 + (uint64_t)(*p - '0');
                p++;
            }
            size_t width = (size_t)(p - digits);
            if (width == 0 || width > 19 || (width > 1 && *digits == '0')) return SCAN_OTHER;
            if (p < end && (*p == '.' || *p == 'e' || *p == 'E' || (*p >= '0' && *p <= '9')))
                return SCAN_OTHER; /* a float, or more digits than an int64 holds */
            if (magnitude > (uint64_t)INT64_MAX + (uint64_t)negative) return SCAN_OTHER;
            value = negative ? (int64_t)(0 - magnitude) : (int64_t)magnitude;
            token = (const char *)&value;
            n = sizeof value;
        }
        int64_t entry = scanner_entry(s, token, n);
        if (entry < 0) return SCAN_NOMEM;
        if (push_id(o, (uint32_t)entry, (size_t)(p - array)) < 0) return SCAN_NOMEM;
        ++*count;
    }
}

/* One line: a JSON object holding exactly one top-level `hash_ids` (its array from
 * *array to *array_end). */
static int scan_line(IdScanner *s, const char *p, const char *end, Scanned *o,
                     const char **array, const char **array_end) {
    size_t count = 0;
    int found = 0;
    p = skip_spaces(p, end);
    if (p == end || *p != '{') return SCAN_OTHER;
    p = skip_spaces(p + 1, end);
    if (p < end && *p == '}') return SCAN_OTHER; /* no hash_ids */
    while (1) {
        if (p == end || *p != '"') return SCAN_OTHER;
        const char *key = ++p;
        while (p < end && *p != '"') {
            if (*p == '\\') return SCAN_OTHER;
            p++;
        }
        if (p == end) return SCAN_OTHER;
        size_t key_length = (size_t)(p - key);
        p = skip_spaces(p + 1, end);
        if (p == end || *p != ':') return SCAN_OTHER;
        p = skip_spaces(p + 1, end);
        if (key_length == 8 && memcmp(key, "hash_ids", 8) == 0) {
            if (found) return SCAN_OTHER;
            found = 1;
            *array = p;
            int status = scan_array(s, p, end, o, &count, &p);
            if (status != SCAN_OK) return status;
            *array_end = p;
        } else if ((p = skip_value(p, end)) == NULL) {
            return SCAN_OTHER;
        }
        p = skip_spaces(p, end);
        if (p == end) return SCAN_OTHER;
        if (*p == '}') break;
        if (*p != ',') return SCAN_OTHER;
        p = skip_spaces(p + 1, end);
    }
    if (skip_spaces(p + 1, end) != end || !found) return SCAN_OTHER;
    return push_line(o, count) < 0 ? SCAN_NOMEM : SCAN_OK;
}

static int scan_chunk(IdScanner *s, const char *data, size_t size, Scanned *o) {
    const char *p = data, *end = data + size;
    while (p < end) {
        const char *line_end = memchr(p, '\n', (size_t)(end - p));
        if (line_end == NULL) line_end = end;
        const char *array = NULL, *array_end = NULL;
        int status = scan_line(s, p, line_end, o, &array, &array_end);
        if (status != SCAN_OK) return status;
        if (push_text(o, p, (size_t)(array - p)) < 0 || push_text(o, "null", 4) < 0 ||
            push_text(o, array_end, (size_t)(line_end - array_end)) < 0 ||
            (line_end < end && push_text(o, "\n", 1) < 0))
            return SCAN_NOMEM;
        p = line_end + 1;
    }
    return SCAN_OK;
}

/* Convert the tokens added since the last call: hashed (strings) or read (ints), then
 * one object per id value through `interned`. */
static int scanner_convert(IdScanner *s) {
    for (; s->converted < s->n_entries; s->converted++) {
        Entry *entry = &s->entries[s->converted];
        const char *token = s->arena + entry->offset;
        PyObject *value;
        if (s->strings) {
            value = PyLong_FromUnsignedLongLong(hash63((const uint8_t *)token, entry->length));
        } else {
            int64_t v;
            memcpy(&v, token, sizeof v);
            value = PyLong_FromLongLong(v);
        }
        if (value == NULL) return -1;
        PyObject *kept = PyDict_SetDefault(s->interned, value, value); /* borrowed */
        Py_DECREF(value);
        if (kept == NULL) return -1;
        Py_INCREF(kept);
        entry->value = kept;
    }
    return 0;
}

static PyObject *scanner_scan(IdScanner *s, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    if (s->busy) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_RuntimeError, "IdScanner.scan: already scanning");
        return NULL;
    }
    s->busy = 1;
    Scanned o = {0};
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = scan_chunk(s, (const char *)view.buf, (size_t)view.len, &o);
    Py_END_ALLOW_THREADS
    s->busy = 0;
    PyObject *out = NULL;
    if (scanner_convert(s) < 0) goto done; /* new tokens of a refused chunk are kept too */
    if (status == SCAN_NOMEM) {
        PyErr_NoMemory();
        goto done;
    }
    if (status == SCAN_OTHER) {
        out = Py_NewRef(Py_None);
        goto done;
    }
    out = PyList_New((Py_ssize_t)o.n_lines);
    if (out == NULL) goto done;
    const uint32_t *id = o.ids;
    for (size_t r = 0; r < o.n_lines; r++) {
        PyObject *row = PyTuple_New((Py_ssize_t)o.counts[r]);
        if (row == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        for (size_t k = 0; k < o.counts[r]; k++) {
            PyObject *value = s->entries[*id++].value;
            Py_INCREF(value);
            PyTuple_SET_ITEM(row, (Py_ssize_t)k, value);
        }
        PyObject_GC_UnTrack(row); /* ints only: as the collector itself would untrack it */
        PyList_SET_ITEM(out, (Py_ssize_t)r, row);
    }
    PyObject *text = PyBytes_FromStringAndSize(o.text ? o.text : "", (Py_ssize_t)o.text_len);
    PyObject *pair = text == NULL ? NULL : PyTuple_Pack(2, out, text);
    Py_XDECREF(text);
    Py_SETREF(out, pair);
done:
    free(o.ids);
    free(o.ends);
    free(o.counts);
    free(o.text);
    PyBuffer_Release(&view);
    return out;
}

static int scanner_init(IdScanner *s, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"interned", "strings", NULL};
    PyObject *interned;
    int strings;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!p:IdScanner", names, &PyDict_Type,
                                     &interned, &strings))
        return -1;
    if (s->interned != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "IdScanner: already initialized");
        return -1;
    }
    s->interned = Py_NewRef(interned);
    s->strings = strings;
    return 0;
}

static void scanner_dealloc(IdScanner *s) {
    for (size_t e = 0; e < s->converted; e++) Py_XDECREF(s->entries[e].value);
    Py_XDECREF(s->interned);
    free(s->slots);
    free(s->entries);
    free(s->arena);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *scanner_distinct(IdScanner *s, void *closure) {
    return PyLong_FromSize_t(s->n_entries);
}

static PyMethodDef scanner_methods[] = {
    {"scan", (PyCFunction)scanner_scan, METH_O,
     "scan(chunk) -> (list[tuple], bytes) | None: each line's hash_ids as a tuple of ids, "
     "and the chunk with every hash_ids array written as null (what a JSON parser then "
     "reads without tokenizing the ids); None when a line needs the JSON parser."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef scanner_getset[] = {
    {"distinct", (getter)scanner_distinct, NULL, "Distinct tokens seen so far.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject IdScannerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "btb_lab.workload._hashc.IdScanner",
    .tp_basicsize = sizeof(IdScanner),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "IdScanner(interned, strings): the hash_ids of JSONL chunks, one object per id.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)scanner_init,
    .tp_dealloc = (destructor)scanner_dealloc,
    .tp_methods = scanner_methods,
    .tp_getset = scanner_getset,
};

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

PyMODINIT_FUNC PyInit__hashc(void) {
    if (PyType_Ready(&IdScannerType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "IdScanner", (PyObject *)&IdScannerType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
