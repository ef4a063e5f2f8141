/* The compiled prefix cache: `PrefixCache` and `RoutedBlocks` of btb_lab/sim/cache.py, rule
 * for rule, over one table per instance instead of four dicts.
 *
 * Each block an instance knows of is one entry: its key (the block id object, owned), its
 * places in the HBM and host-RAM LRUs (doubly linked lists through the entries), its pin
 * count and its pending mark. At most one hash probe per block per operation answers every
 * question the Python class asks of its dicts one by one, and no object is allocated per
 * block; an operation walking a prefix that an earlier one walked follows the entries'
 * `after` links instead of probing (`walk`). An entry goes when it holds nothing (not
 * resident, not pinned, not pending).
 *
 * The Python classes are the reference: tests/unit/test_sim_cache_model.py runs both
 * against the same model, and tests/unit/test_sim_cache_impl.py checks that whole runs give
 * byte-identical records with either. Keys are compared as Python objects (hash, then
 * identity, then ==), so any block id the Python class accepts works here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>

#define F_HBM 1
#define F_RAM 2
#define F_PEND 4
#define NONE_I (-1)

static PyObject *InvariantError = NULL; /* btb_lab.sim.cache.SimInvariantError, set by init() */

typedef struct {
    PyObject *key;
    Py_hash_t hash;
    int32_t hprev, hnext; /* HBM LRU (the routed LRU for RoutedBlocks); free list in hnext */
    int32_t rprev, rnext; /* host-RAM LRU */
    int32_t pins;
    int32_t flags;
    int32_t after; /* the entry that followed this one in the last walk that probed for it */
    int32_t mark;  /* RoutedBlocks: which memo's walk held it (`memo_mark`, MARK_SHARED) */
    double pending_s;
} Entry;

#define FIRST_BITS 4

typedef struct {
    int32_t i;    /* the entry */
    uint32_t tag; /* its hash_tag: the home slot in its low bits */
} Slot;

typedef struct {
    Entry *e;
    int32_t n_alloc, n_live, free_head;
    Slot *slot; /* open addressing, linear probing; `i` NONE_I when empty */
    size_t mask;
    /* the entries walks began at lately, by their key's address (FIRST_BITS): every
     * operation on a prefix begins a walk at its first block, which has no entry before
     * it to give a hint */
    int32_t first[1 << FIRST_BITS];
} Table;

/* The top `bits` bits of an object's address, Fibonacci-hashed: objects' low address
 * bits are alike. */
static inline int address_bits(PyObject *obj, int bits) {
    return (int)(((uint64_t)(uintptr_t)obj * 0x9E3779B97F4A7C15ULL) >> (64 - bits));
}

typedef struct {
    int32_t head, tail; /* oldest, newest */
    Py_ssize_t n;
} List;

/* ------------------------------------------------------------------ table */
static int table_init(Table *t) {
    t->n_alloc = 64;
    t->e = PyMem_Malloc(sizeof(Entry) * (size_t)t->n_alloc);
    t->mask = 127;
    t->slot = PyMem_Malloc(sizeof(Slot) * (t->mask + 1));
    if (!t->e || !t->slot) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t k = 0; k <= t->mask; k++) t->slot[k].i = NONE_I;
    for (int32_t i = 0; i < t->n_alloc; i++) {
        t->e[i].key = NULL;
        t->e[i].after = NONE_I;
        t->e[i].hnext = i + 1 < t->n_alloc ? i + 1 : NONE_I;
    }
    t->free_head = 0;
    t->n_live = 0;
    for (int k = 0; k < (1 << FIRST_BITS); k++) t->first[k] = NONE_I;
    return 0;
}

static void table_free(Table *t) {
    if (t->e) {
        for (int32_t i = 0; i < t->n_alloc; i++) Py_XDECREF(t->e[i].key);
        PyMem_Free(t->e);
    }
    PyMem_Free(t->slot);
    t->e = NULL;
    t->slot = NULL;
}

/* The slot a hash probes first is its tag's low bits. Python hashes an int to its value,
 * and a trace's integer ids (Mooncake's) count up, so `hash & mask` would lay the live
 * blocks out as long runs of full slots: every deletion then shifts back a whole run,
 * every probe into one walks to its end. Fibonacci hashing spreads consecutive hashes
 * over the table. A slot keeps its entry's tag beside the index, so a probe passes other
 * entries, and a deletion shifts them back, without reading the entries themselves (a
 * cache miss each on a large table). */
static inline uint32_t hash_tag(Py_hash_t hash) {
    uint64_t x = (uint64_t)hash * 0x9E3779B97F4A7C15ULL;
    return (uint32_t)(x ^ (x >> 32));
}

/* The slot of `key` (hash `hash`, its tag `tag`), or of the empty slot where its probe
 * ends; `*i`: its entry, or NONE_I; -1 with an exception set. */
static inline int table_probe(Table *t, PyObject *key, Py_hash_t hash, uint32_t tag,
                              size_t *k_out, int32_t *i_out) {
    size_t k = tag & t->mask;
    for (;;) {
        Slot sl = t->slot[k];
        if (sl.i == NONE_I) break;
        if (sl.tag == tag) {
            Entry *e = &t->e[sl.i];
            if (e->key == key) {
                *k_out = k;
                *i_out = sl.i;
                return 0;
            }
            if (e->hash == hash) {
                int eq = PyObject_RichCompareBool(e->key, key, Py_EQ);
                if (eq < 0) return -1;
                if (eq > 0) {
                    *k_out = k;
                    *i_out = sl.i;
                    return 0;
                }
            }
        }
        k = (k + 1) & t->mask;
    }
    *k_out = k;
    *i_out = NONE_I;
    return 0;
}

/* The entry of `key` (hash `hash`), or NONE_I; -2 with an exception set. */
static inline int32_t table_find(Table *t, PyObject *key, Py_hash_t hash) {
    size_t k;
    int32_t i;
    if (table_probe(t, key, hash, hash_tag(hash), &k, &i) < 0) return -2;
    return i;
}

static int table_grow_slots(Table *t) {
    size_t size = (t->mask + 1) * 2;
    Slot *slot = PyMem_Malloc(sizeof(Slot) * size);
    if (!slot) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t k = 0; k < size; k++) slot[k].i = NONE_I;
    size_t mask = size - 1;
    for (size_t j = 0; j <= t->mask; j++) {
        Slot sl = t->slot[j];
        if (sl.i == NONE_I) continue;
        size_t k = sl.tag & mask;
        while (slot[k].i != NONE_I) k = (k + 1) & mask;
        slot[k] = sl;
    }
    PyMem_Free(t->slot);
    t->slot = slot;
    t->mask = mask;
    return 0;
}

/* The entry of `key`, created empty if absent; -2 with an exception set. */
static int32_t table_get(Table *t, PyObject *key, Py_hash_t hash) {
    uint32_t tag = hash_tag(hash);
    size_t k;
    int32_t i;
    if (table_probe(t, key, hash, tag, &k, &i) < 0) return -2;
    if (i != NONE_I) return i;
    if ((size_t)(t->n_live + 1) * 2 > t->mask + 1) {
        if (table_grow_slots(t) < 0) return -2;
        k = tag & t->mask; /* where the probe ends in the grown table */
        while (t->slot[k].i != NONE_I) k = (k + 1) & t->mask;
    }
    if (t->free_head == NONE_I) {
        int32_t n = t->n_alloc * 2;
        Entry *e = PyMem_Realloc(t->e, sizeof(Entry) * (size_t)n);
        if (!e) {
            PyErr_NoMemory();
            return -2;
        }
        for (int32_t j = t->n_alloc; j < n; j++) {
            e[j].key = NULL;
            e[j].after = NONE_I;
            e[j].hnext = j + 1 < n ? j + 1 : NONE_I;
        }
        t->free_head = t->n_alloc;
        t->e = e;
        t->n_alloc = n;
    }
    i = t->free_head;
    Entry *e = &t->e[i];
    t->free_head = e->hnext;
    Py_INCREF(key);
    e->key = key;
    e->hash = hash;
    e->hprev = e->hnext = e->rprev = e->rnext = e->after = NONE_I;
    e->pins = 0;
    e->flags = 0;
    e->mark = -1;
    e->pending_s = 0.0;
    t->slot[k].i = i;
    t->slot[k].tag = tag;
    t->n_live++;
    return i;
}

/* Forget entry `i` if it holds nothing (backward-shift deletion keeps probing exact). */
static void table_release(Table *t, int32_t i) {
    Entry *e = &t->e[i];
    if (e->flags || e->pins) return;
    size_t mask = t->mask;
    size_t k = hash_tag(e->hash) & mask;
    while (t->slot[k].i != i) k = (k + 1) & mask;
    size_t hole = k;
    for (;;) {
        k = (k + 1) & mask;
        Slot sl = t->slot[k];
        if (sl.i == NONE_I) break;
        size_t home = sl.tag & mask;
        /* move it back into the hole unless its home lies cyclically in (hole, k] */
        int in_between = hole <= k ? (home > hole && home <= k) : (home > hole || home <= k);
        if (!in_between) {
            t->slot[hole] = sl;
            hole = k;
        }
    }
    t->slot[hole].i = NONE_I;
    Py_CLEAR(e->key);
    e->hnext = t->free_head;
    t->free_head = i;
    t->n_live--;
}

/* The entry of `key`, the block after the one whose entry is `*cur` (NONE_I for a walk's
 * first block); `create`: added when absent. Blocks of a prefix come in the same order
 * request after request, and a trace's occurrences of an id share one int object, so the
 * entry that followed `*cur` last time is checked first (by identity, then by hash and
 * equality: there is one entry per key) before probing the table. The hint is only ever
 * verified, never trusted: a released or reused entry fails the check. Moves
 * `*cur` to the result (NONE_I when absent); -2 with an exception set. */
static int32_t walk_probe(Table *t, PyObject *key, int32_t *cur, int create, int32_t next);

/* `walk` runs once per block of every cache operation: its hint check is compiled into
 * each loop (forced: GCC left it a call), the probe stays out of line. */
#if defined(__GNUC__) || defined(__clang__)
#define HOT static inline __attribute__((always_inline))
#define COLD static __attribute__((noinline))
#else
#define HOT static inline
#define COLD static
#endif

HOT int32_t walk(Table *t, PyObject *key, int32_t *cur, int create) {
    int32_t prev = *cur;
    int32_t next = prev != NONE_I ? t->e[prev].after : t->first[address_bits(key, FIRST_BITS)];
    if (next != NONE_I && t->e[next].key == key) {
        *cur = next;
        return next;
    }
    return walk_probe(t, key, cur, create, next);
}

COLD int32_t walk_probe(Table *t, PyObject *key, int32_t *cur, int create, int32_t next) {
    int32_t prev = *cur;
    Py_hash_t hash = PyObject_Hash(key);
    if (hash == -1) return -2;
    if (next != NONE_I && t->e[next].key != NULL && t->e[next].hash == hash) {
        /* an equal id in another object (generated ids, another load batch) */
        int eq = PyObject_RichCompareBool(t->e[next].key, key, Py_EQ);
        if (eq < 0) return -2;
        if (eq) {
            *cur = next;
            return next;
        }
    }
    int32_t i = create ? table_get(t, key, hash) : table_find(t, key, hash);
    if (i == -2) return -2;
    if (i != NONE_I && i != prev) {
        if (prev != NONE_I) t->e[prev].after = i;
        else t->first[address_bits(key, FIRST_BITS)] = i;
    }
    *cur = i;
    return i;
}

/* ------------------------------------------------------------------ LRU lists */
#define LINK(t, i, P, N, l)                                  \
    do {                                                     \
        Entry *e_ = &(t)->e[i];                              \
        e_->P = (l)->tail;                                   \
        e_->N = NONE_I;                                      \
        if ((l)->tail != NONE_I) (t)->e[(l)->tail].N = (i);  \
        else (l)->head = (i);                                \
        (l)->tail = (i);                                     \
        (l)->n++;                                            \
    } while (0)

#define UNLINK(t, i, P, N, l)                                    \
    do {                                                         \
        Entry *e_ = &(t)->e[i];                                  \
        if (e_->P != NONE_I) (t)->e[e_->P].N = e_->N;            \
        else (l)->head = e_->N;                                  \
        if (e_->N != NONE_I) (t)->e[e_->N].P = e_->P;            \
        else (l)->tail = e_->P;                                  \
        e_->P = e_->N = NONE_I;                                  \
        (l)->n--;                                                \
    } while (0)

/* Moving blocks to the newest end one by one leaves them there in the order they were
 * moved (a block moved twice where it was moved last), the others in their order before.
 * A `Run` builds the same list: the blocks moved so far are kept as one stretch of it
 * (`first`..`last`), each next one put right after `last` unless it is there already, and
 * `run_to_newest` moves the stretch to the end at once. A prefix moved again, as a burst
 * moves it request after request, is already such a stretch: nothing is relinked. Only
 * the HBM list's links (hprev, hnext), which RoutedBlocks' LRU uses too. */
typedef struct {
    int32_t first, last;
} Run;

#define RUN_EMPTY {NONE_I, NONE_I}

/* Entry `i` (in no list) into `l` right after entry `a`. */
static inline void link_after(Table *t, List *l, int32_t a, int32_t i) {
    Entry *ea = &t->e[a], *ei = &t->e[i];
    ei->hprev = a;
    ei->hnext = ea->hnext;
    if (ea->hnext != NONE_I) t->e[ea->hnext].hprev = i;
    else l->tail = i;
    ea->hnext = i;
    l->n++;
}

/* Entry `i`, in `l` (`linked`) or in no list, moved to the newest end (see Run). */
static inline void run_move(Table *t, List *l, Run *r, int32_t i, int linked) {
    if (!linked) {
        if (r->last == NONE_I) {
            LINK(t, i, hprev, hnext, l);
            r->first = i;
        } else {
            link_after(t, l, r->last, i);
        }
    } else if (r->last == NONE_I) { /* the stretch starts where the first block is */
        r->first = i;
    } else if (i != r->last && t->e[i].hprev != r->last) {
        if (i == r->first) r->first = t->e[i].hnext; /* from the stretch's start to its end */
        UNLINK(t, i, hprev, hnext, l);
        link_after(t, l, r->last, i);
    }
    r->last = i;
}

static inline void run_to_newest(Table *t, List *l, Run *r) {
    if (r->last == NONE_I || r->last == l->tail) return;
    Entry *ef = &t->e[r->first], *el = &t->e[r->last];
    int32_t before = ef->hprev, after = el->hnext;
    if (before != NONE_I) t->e[before].hnext = after;
    else l->head = after;
    t->e[after].hprev = before;
    ef->hprev = l->tail;
    t->e[l->tail].hnext = r->first;
    el->hnext = NONE_I;
    l->tail = r->last;
}

/* ------------------------------------------------------------------ arguments */
typedef struct {
    PyObject *fast; /* a list or tuple (owned) */
    PyObject **items;
    Py_ssize_t len;
} Seq;

static int seq_open(Seq *s, PyObject *obj) {
    s->fast = PySequence_Fast(obj, "block hashes must be a sequence");
    if (!s->fast) return -1;
    s->items = PySequence_Fast_ITEMS(s->fast);
    s->len = PySequence_Fast_GET_SIZE(s->fast);
    return 0;
}

static inline void seq_close(Seq *s) { Py_CLEAR(s->fast); }

/* Python's slice bounds for hashes[lo:hi] with lo, hi >= 0. */
static inline Py_ssize_t clamp(Py_ssize_t v, Py_ssize_t len) { return v < 0 ? 0 : (v > len ? len : v); }

static inline long long floordiv(long long a, long long b) {
    long long q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

/* ------------------------------------------------------------------ PrefixCache */
typedef struct {
    PyObject_HEAD
    Table t;
    List hbm, ram;
    Py_ssize_t n_pins, n_pending;
    PyObject *name, *disk;
    long long cap_tokens, block_tokens, ram_cap_blocks, reserved, pinned_tokens;
    char cache_whole, stale_pending;
} Cache;

/* A walk over a run of blocks: each function that uses FIND or GET declares `WALK;` first. */
#define WALK int32_t cur_ = NONE_I

#define FIND(c, h, i, fail)                      \
    int32_t i = walk(&(c)->t, (h), &cur_, 0);    \
    if (i == -2) goto fail

#define GET(c, h, i, fail)                       \
    int32_t i = walk(&(c)->t, (h), &cur_, 1);    \
    if (i < 0) goto fail

static int cache_init(Cache *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"name", "cap_tokens", "block_tokens", "ram_cap_blocks", "disk",
                             "cache_whole", NULL};
    PyObject *name, *disk = Py_None;
    long long cap, bt, ram_cap = 0;
    int whole = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OLL|$LOp", kwlist, &name, &cap, &bt, &ram_cap,
                                     &disk, &whole))
        return -1;
    if (bt <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_tokens must be positive");
        return -1;
    }
    if (disk != Py_None && !PySet_Check(disk)) {
        PyErr_SetString(PyExc_TypeError, "disk must be a set or None");
        return -1;
    }
    if (self->t.e == NULL && table_init(&self->t) < 0) return -1;
    Py_INCREF(name);
    Py_XSETREF(self->name, name);
    Py_INCREF(disk);
    Py_XSETREF(self->disk, disk);
    self->cap_tokens = cap;
    self->block_tokens = bt;
    self->ram_cap_blocks = ram_cap;
    self->cache_whole = (char)whole;
    self->reserved = 0;
    self->pinned_tokens = 0;
    self->stale_pending = 0;
    self->hbm.head = self->hbm.tail = self->ram.head = self->ram.tail = NONE_I;
    self->hbm.n = self->ram.n = 0;
    self->n_pins = self->n_pending = 0;
    return 0;
}

static void cache_dealloc(Cache *self) {
    table_free(&self->t);
    Py_XDECREF(self->name);
    Py_XDECREF(self->disk);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static inline int has_disk(Cache *c) { return c->disk != Py_None; }

/* RAM's overflow goes to disk (or is dropped): as `fit` and `demote` do. */
static int ram_overflow(Cache *c) {
    Table *t = &c->t;
    while (c->ram.n > c->ram_cap_blocks) {
        int32_t old = c->ram.head;
        UNLINK(t, old, rprev, rnext, &c->ram);
        t->e[old].flags &= ~F_RAM;
        if (has_disk(c) && PySet_Add(c->disk, t->e[old].key) < 0) return -1;
        table_release(t, old);
    }
    return 0;
}

static void unmark(Cache *c, int32_t i) {
    Entry *e = &c->t.e[i];
    if (e->flags & F_PEND) {
        e->flags &= ~F_PEND;
        c->n_pending--;
        table_release(&c->t, i);
    }
}

static PyObject *cache_fit(Cache *c, PyObject *unused) {
    long long bt = c->block_tokens;
    long long allowed = c->cache_whole ? floordiv(c->cap_tokens, bt)
                                       : floordiv(c->cap_tokens - c->reserved, bt);
    if (c->hbm.n <= allowed) Py_RETURN_NONE;
    Table *t = &c->t;
    long long excess = c->hbm.n - allowed;
    Py_ssize_t skipped = 0;
    while (excess) {
        int32_t i = c->hbm.head;
        UNLINK(t, i, hprev, hnext, &c->hbm);
        Entry *e = &t->e[i];
        if (e->pins) { /* in use: it stays resident, now the most recent */
            LINK(t, i, hprev, hnext, &c->hbm);
            skipped++;
            if (skipped > c->n_pins) {
                PyErr_Format(InvariantError, "%U: pinned blocks exceed the KV budget", c->name);
                return NULL;
            }
            continue;
        }
        excess--;
        e->flags &= ~F_HBM;
        if (c->ram_cap_blocks) {
            e->flags |= F_RAM;
            LINK(t, i, rprev, rnext, &c->ram);
            if (c->ram.n > c->ram_cap_blocks && ram_overflow(c) < 0) return NULL;
        } else {
            if (has_disk(c) && PySet_Add(c->disk, e->key) < 0) return NULL;
            table_release(t, i);
        }
    }
    Py_RETURN_NONE;
}

/* Leading entries of `s` with any of `mask` set (`pinned`: with pins). */
static PyObject *lead_where(Cache *c, PyObject *obj, int mask, int pinned) {
    Seq s;
    if (seq_open(&s, obj) < 0) return NULL;
    Py_ssize_t n = 0;
    WALK;
    for (; n < s.len; n++) {
        FIND(c, s.items[n], i, fail);
        if (i == NONE_I) break;
        Entry *e = &c->t.e[i];
        if (pinned ? !e->pins : !(e->flags & mask)) break;
    }
    seq_close(&s);
    return PyLong_FromSsize_t(n);
fail:
    seq_close(&s);
    return NULL;
}

static PyObject *cache_lead(Cache *c, PyObject *h) { return lead_where(c, h, F_HBM, 0); }
static PyObject *cache_lead_pinned(Cache *c, PyObject *h) { return lead_where(c, h, 0, 1); }
static PyObject *cache_host_lead(Cache *c, PyObject *h) { return lead_where(c, h, F_HBM | F_RAM, 0); }

/* The run over pending blocks from `start`: (end, latest completion). */
static int pending_run(Cache *c, Seq *s, Py_ssize_t start, double *ready, Py_ssize_t *end) {
    Py_ssize_t k = start;
    WALK;
    for (; k < s->len; k++) {
        FIND(c, s->items[k], i, fail);
        if (i == NONE_I || !(c->t.e[i].flags & F_PEND)) break;
        if (c->t.e[i].pending_s > *ready) *ready = c->t.e[i].pending_s;
    }
    *end = k;
    return 0;
fail:
    return -1;
}

static PyObject *cache_pending_run(Cache *c, PyObject *args) {
    PyObject *obj;
    Py_ssize_t start;
    double ready;
    if (!PyArg_ParseTuple(args, "Ond", &obj, &start, &ready)) return NULL;
    Seq s;
    if (seq_open(&s, obj) < 0) return NULL;
    Py_ssize_t end;
    if (pending_run(c, &s, clamp(start, s.len), &ready, &end) < 0) {
        seq_close(&s);
        return NULL;
    }
    seq_close(&s);
    return Py_BuildValue("nd", end < start ? start : end, ready);
}

static PyObject *cache_locate(Cache *c, PyObject *args) {
    PyObject *obj;
    double now;
    if (!PyArg_ParseTuple(args, "Od", &obj, &now)) return NULL;
    Seq s;
    if (seq_open(&s, obj) < 0) return NULL;
    Table *t = &c->t;
    Py_ssize_t n = 0, n_ram = 0, n_disk = 0;
    WALK;
    for (; n < s.len; n++) {
        FIND(c, s.items[n], i, fail);
        if (i == NONE_I || !(t->e[i].flags & F_HBM)) break;
    }
    Py_ssize_t n_hbm = n;
    if (n < s.len && (c->ram.n || has_disk(c))) {
        for (; n < s.len; n++) {
            PyObject *h = s.items[n];
            FIND(c, h, i, fail);
            int flags = i == NONE_I ? 0 : t->e[i].flags;
            if (flags & F_HBM) continue;
            if (flags & F_RAM) {
                n_ram++;
                continue;
            }
            if (has_disk(c)) {
                int in = PySet_Contains(c->disk, h);
                if (in < 0) goto fail;
                if (in) {
                    n_disk++;
                    continue;
                }
            }
            break;
        }
    }
    Py_ssize_t m = n;
    double ready = now;
    if (c->n_pending && n < s.len && pending_run(c, &s, n, &ready, &m) < 0) goto fail;
    seq_close(&s);
    return Py_BuildValue("nnnnnd", n_hbm, n, n_ram, n_disk, m, ready);
fail:
    seq_close(&s);
    return NULL;
}

/* hashes[lo:hi] become the most recent HBM blocks (from RAM if there); `move`: reorder the
 * resident ones too (touch), else leave them (promote). */
static int touch_range(Cache *c, Seq *s, Py_ssize_t lo, Py_ssize_t hi, int move) {
    Table *t = &c->t;
    WALK;
    for (Py_ssize_t k = lo; k < hi; k++) {
        GET(c, s->items[k], i, fail);
        Entry *e = &t->e[i];
        if (e->flags & F_HBM) {
            if (move) {
                UNLINK(t, i, hprev, hnext, &c->hbm);
                LINK(t, i, hprev, hnext, &c->hbm);
            }
            continue;
        }
        e->flags |= F_HBM;
        LINK(t, i, hprev, hnext, &c->hbm);
        if (e->flags & F_RAM) {
            e->flags &= ~F_RAM;
            UNLINK(t, i, rprev, rnext, &c->ram);
        }
        if (e->flags & F_PEND) c->stale_pending = 1;
    }
    return 0;
fail:
    return -1;
}

static int unmark_range(Cache *c, Seq *s, Py_ssize_t lo, Py_ssize_t hi) {
    WALK;
    for (Py_ssize_t k = lo; k < hi && c->n_pending; k++) {
        FIND(c, s->items[k], i, fail);
        if (i != NONE_I) unmark(c, i);
    }
    return 0;
fail:
    return -1;
}

static PyObject *cache_insert(Cache *c, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"hashes", "fit", NULL};
    PyObject *obj;
    int fit = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|$p", kwlist, &obj, &fit)) return NULL;
    Seq s;
    if (seq_open(&s, obj) < 0) return NULL;
    if (touch_range(c, &s, 0, s.len, 1) < 0 || unmark_range(c, &s, 0, s.len) < 0) {
        seq_close(&s);
        return NULL;
    }
    seq_close(&s);
    if (fit) return cache_fit(c, NULL);
    Py_RETURN_NONE;
}

static PyObject *cache_touch(Cache *c, PyObject *args) {
    PyObject *obj;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "On", &obj, &n)) return NULL;
    Seq s;
    if (seq_open(&s, obj) < 0) return NULL;
    int rc = touch_range(c, &s, 0, clamp(n, s.len), 1);
    seq_close(&s);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *cache_promote(Cache *c, PyObject *args) {
    PyObject *obj;
    Py_ssize_t start, n;
    if (!PyArg_ParseTuple(args, "Onn", &obj, &start, &n)) return NULL;
    Seq s;
    if (seq_open(&s, obj) < 0) return NULL;
    int rc = touch_range(c, &s, clamp(start, s.len), clamp(n, s.len), 0);
    seq_close(&s);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *cache_insert_arrived(Cache *c, PyObject *args) {
    PyObject *obj;
    double now, eps;
    if (!PyArg_ParseTuple(args, "Odd", &obj, &now, &eps)) return NULL;
    Seq s;
    if (seq_open(&s, obj) < 0) return NULL;
    PyObject *due = PyList_New(0);
    if (!due) goto fail;
    WALK;
    for (Py_ssize_t k = 0; k < s.len; k++) {
        FIND(c, s.items[k], i, fail);
        if (i != NONE_I && (c->t.e[i].flags & F_PEND) && c->t.e[i].pending_s <= now + eps &&
            PyList_Append(due, s.items[k]) < 0)
            goto fail;
    }
    seq_close(&s);
    Seq d;
    if (seq_open(&d, due) < 0) {
        Py_DECREF(due);
        return NULL;
    }
    int rc = touch_range(c, &d, 0, d.len, 1) < 0 || unmark_range(c, &d, 0, d.len) < 0;
    seq_close(&d);
    Py_DECREF(due);
    if (rc) return NULL;
    return cache_fit(c, NULL);
fail:
    Py_XDECREF(due);
    seq_close(&s);
    return NULL;
}

/* Pending marks on the non-resident blocks of hashes[lo:]: `done` (later of the two with
 * `keep_later`). */
static PyObject *expect_common(Cache *c, PyObject *obj, Py_ssize_t lo, double done, int keep_later) {
    Seq s;
    if (seq_open(&s, obj) < 0) return NULL;
    Table *t = &c->t;
    WALK;
    for (Py_ssize_t k = clamp(lo, s.len); k < s.len; k++) {
        GET(c, s.items[k], i, fail); /* a new entry holds nothing: not resident */
        if (t->e[i].flags & F_HBM) continue;
        Entry *e = &t->e[i];
        if (e->flags & F_PEND) {
            if (!keep_later || done > e->pending_s) e->pending_s = done;
        } else {
            e->flags |= F_PEND;
            c->n_pending++;
            e->pending_s = keep_later && done < 0.0 ? 0.0 : done;
        }
    }
    seq_close(&s);
    Py_RETURN_NONE;
fail:
    seq_close(&s);
    return NULL;
}

static PyObject *cache_expect(Cache *c, PyObject *args) {
    PyObject *obj;
    Py_ssize_t start;
    double done;
    if (!PyArg_ParseTuple(args, "Ond", &obj, &start, &done)) return NULL;
    return expect_common(c, obj, start, done, 0);
}

static PyObject *cache_expect_copy(Cache *c, PyObject *args) {
    PyObject *obj;
    double done;
    if (!PyArg_ParseTuple(args, "Od", &obj, &done)) return NULL;
    return expect_common(c, obj, 0, done, 1);
}

static PyObject *cache_pin(Cache *c, PyObject *args) {
    PyObject *obj;
    Py_ssize_t start, upto;
    if (!PyArg_ParseTuple(args, "Onn", &obj, &start, &upto)) return NULL;
    if (upto <= start) return PyLong_FromLong(0);
    Seq s;
    if (seq_open(&s, obj) < 0) return NULL;
    if (start < 0 || upto > s.len) {
        seq_close(&s);
        PyErr_SetString(PyExc_IndexError, "pin range outside the block hashes");
        return NULL;
    }
    Py_ssize_t n0 = c->n_pins;
    WALK;
    for (Py_ssize_t k = start; k < upto; k++) {
        GET(c, s.items[k], i, fail);
        if (!c->t.e[i].pins++) c->n_pins++;
    }
    seq_close(&s);
    c->pinned_tokens += (long long)(c->n_pins - n0) * c->block_tokens;
    return PyLong_FromLongLong((long long)(upto - start) * c->block_tokens);
fail:
    seq_close(&s);
    return NULL;
}

static PyObject *cache_insert_pinned(Cache *c, PyObject *args) {
    PyObject *obj;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "On", &obj, &start)) return NULL;
    Seq s;
    if (seq_open(&s, obj) < 0) return NULL;
    Table *t = &c->t;
    Py_ssize_t n0 = c->n_pins, lo = clamp(start, s.len);
    /* hashes[:start] are pinned by the caller: resident, and their order never matters */
    WALK;
    for (Py_ssize_t k = lo; k < s.len; k++) {
        GET(c, s.items[k], i, fail);
        Entry *e = &t->e[i];
        if (!e->pins) {
            if (!(e->flags & F_HBM)) {
                e->flags |= F_HBM;
                LINK(t, i, hprev, hnext, &c->hbm);
                if (e->flags & F_RAM) {
                    e->flags &= ~F_RAM;
                    UNLINK(t, i, rprev, rnext, &c->ram);
                }
            }
            c->n_pins++;
        }
        e->pins++;
    }
    if (c->n_pending) {
        if (unmark_range(c, &s, c->stale_pending || !start ? 0 : lo, s.len) < 0) goto fail;
    } else {
        c->stale_pending = 0;
    }
    seq_close(&s);
    c->pinned_tokens += (long long)(c->n_pins - n0) * c->block_tokens;
    return PyLong_FromLongLong((long long)(s.len - start) * c->block_tokens);
fail:
    seq_close(&s);
    return NULL;
}

static PyObject *cache_unpin(Cache *c, PyObject *args) {
    PyObject *obj;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "On", &obj, &n)) return NULL;
    Seq s;
    if (seq_open(&s, obj) < 0) return NULL;
    Table *t = &c->t;
    Py_ssize_t n0 = c->n_pins, hi = clamp(n, s.len);
    Run run = RUN_EMPTY; /* released blocks become the most recent, in order */
    WALK;
    for (Py_ssize_t k = 0; k < hi; k++) {
        FIND(c, s.items[k], i, fail);
        if (i == NONE_I || !t->e[i].pins || !(t->e[i].flags & F_HBM)) {
            PyErr_SetObject(PyExc_KeyError, s.items[k]);
            goto fail;
        }
        if (!--t->e[i].pins) {
            c->n_pins--;
            run_move(t, &c->hbm, &run, i, 1);
        }
    }
    seq_close(&s);
    run_to_newest(t, &c->hbm, &run);
    c->pinned_tokens -= (long long)(n0 - c->n_pins) * c->block_tokens;
    Py_RETURN_NONE;
fail:
    seq_close(&s);
    run_to_newest(t, &c->hbm, &run); /* those released before the error, as before */
    return NULL;
}

static PyObject *cache_in_ram(Cache *c, PyObject *obj) {
    PyObject *out = PyList_New(0);
    if (!out || !c->ram.n) return out;
    Seq s;
    if (seq_open(&s, obj) < 0) goto fail;
    WALK;
    for (Py_ssize_t k = 0; k < s.len; k++) {
        FIND(c, s.items[k], i, fail);
        if (i != NONE_I && (c->t.e[i].flags & F_RAM) && PyList_Append(out, s.items[k]) < 0)
            goto fail;
    }
    seq_close(&s);
    return out;
fail:
    seq_close(&s);
    Py_DECREF(out);
    return NULL;
}

static PyObject *cache_drop(Cache *c, PyObject *obj) {
    Seq s;
    if (seq_open(&s, obj) < 0) return NULL;
    Table *t = &c->t;
    Py_ssize_t freed = 0;
    WALK;
    for (Py_ssize_t k = 0; k < s.len; k++) {
        FIND(c, s.items[k], i, fail);
        if (i == NONE_I) continue;
        Entry *e = &t->e[i];
        if ((e->flags & F_HBM) && !e->pins) {
            e->flags &= ~F_HBM;
            UNLINK(t, i, hprev, hnext, &c->hbm);
            freed++;
        }
        if (e->flags & F_RAM) {
            e->flags &= ~F_RAM;
            UNLINK(t, i, rprev, rnext, &c->ram);
        }
        if (e->flags & F_PEND) {
            e->flags &= ~F_PEND;
            c->n_pending--;
        }
        table_release(t, i);
    }
    seq_close(&s);
    return PyLong_FromSsize_t(freed);
fail:
    seq_close(&s);
    return NULL;
}

static PyObject *cache_demote(Cache *c, PyObject *obj) {
    PyObject *moved = PyList_New(0);
    if (!moved || !c->ram_cap_blocks) return moved;
    Seq s;
    if (seq_open(&s, obj) < 0) goto fail;
    Table *t = &c->t;
    WALK;
    for (Py_ssize_t k = 0; k < s.len; k++) {
        FIND(c, s.items[k], i, fail);
        if (i == NONE_I) continue;
        Entry *e = &t->e[i];
        if (!(e->flags & F_HBM) || e->pins) continue;
        if (PyList_Append(moved, s.items[k]) < 0) goto fail;
        e->flags = (e->flags & ~F_HBM) | F_RAM;
        UNLINK(t, i, hprev, hnext, &c->hbm);
        LINK(t, i, rprev, rnext, &c->ram);
    }
    seq_close(&s);
    if (ram_overflow(c) < 0) {
        Py_DECREF(moved);
        return NULL;
    }
    return moved;
fail:
    seq_close(&s);
    Py_DECREF(moved);
    return NULL;
}

static PyObject *cache_n_hbm(Cache *c, PyObject *u) { return PyLong_FromSsize_t(c->hbm.n); }
static PyObject *cache_n_pinned(Cache *c, PyObject *u) { return PyLong_FromSsize_t(c->n_pins); }

static PyObject *cache_pin_count(Cache *c, PyObject *h) {
    WALK;
    FIND(c, h, i, fail);
    return PyLong_FromLong(i == NONE_I ? 0 : c->t.e[i].pins);
fail:
    return NULL;
}

static PyObject *cache_snapshot(Cache *c, PyObject *u) {
    Table *t = &c->t;
    PyObject *unpinned = PyList_New(0), *pins = PyDict_New(), *ram = PyList_New(0),
             *pending = PyDict_New();
    if (!unpinned || !pins || !ram || !pending) goto fail;
    for (int32_t i = c->hbm.head; i != NONE_I; i = t->e[i].hnext)
        if (!t->e[i].pins && PyList_Append(unpinned, t->e[i].key) < 0) goto fail;
    for (int32_t i = c->ram.head; i != NONE_I; i = t->e[i].rnext)
        if (PyList_Append(ram, t->e[i].key) < 0) goto fail;
    for (int32_t i = 0; i < t->n_alloc; i++) {
        Entry *e = &t->e[i];
        if (!e->key) continue;
        if (e->pins) {
            PyObject *v = PyLong_FromLong(e->pins);
            if (!v || PyDict_SetItem(pins, e->key, v) < 0) {
                Py_XDECREF(v);
                goto fail;
            }
            Py_DECREF(v);
        }
        if (e->flags & F_PEND) {
            PyObject *v = PyFloat_FromDouble(e->pending_s);
            if (!v || PyDict_SetItem(pending, e->key, v) < 0) {
                Py_XDECREF(v);
                goto fail;
            }
            Py_DECREF(v);
        }
    }
    return Py_BuildValue("NNNN", unpinned, pins, ram, pending);
fail:
    Py_XDECREF(unpinned);
    Py_XDECREF(pins);
    Py_XDECREF(ram);
    Py_XDECREF(pending);
    return NULL;
}

static PyObject *cache_check(Cache *c, PyObject *u) {
    long long bt = c->block_tokens;
    if (c->reserved > c->cap_tokens)
        return PyErr_Format(InvariantError, "%U: reserved KV above budget", c->name);
    long long cache_cap = c->cache_whole ? c->cap_tokens : c->cap_tokens - c->reserved;
    if ((long long)c->hbm.n * bt > cache_cap)
        return PyErr_Format(InvariantError, "%U: HBM cache above its budget", c->name);
    if ((long long)c->n_pins * bt + c->reserved > c->cap_tokens)
        return PyErr_Format(InvariantError, "%U: pinned + reserved KV above budget", c->name);
    if (c->pinned_tokens != (long long)c->n_pins * bt)
        return PyErr_Format(InvariantError, "%U: pinned token count %lld is off", c->name,
                            c->pinned_tokens);
    Table *t = &c->t;
    for (int32_t i = 0; i < t->n_alloc; i++) {
        Entry *e = &t->e[i];
        if (!e->key) continue;
        if (e->pins < 0)
            return PyErr_Format(InvariantError, "%U: block %R pinned %d times", c->name, e->key,
                                e->pins);
        if (e->pins && !(e->flags & F_HBM))
            return PyErr_Format(InvariantError, "%U: pinned block %R was evicted", c->name, e->key);
        if ((e->flags & F_HBM) && (e->flags & F_RAM))
            return PyErr_Format(InvariantError, "%U: a block is in HBM and host RAM at once",
                                c->name);
    }
    if (c->ram.n > c->ram_cap_blocks)
        return PyErr_Format(InvariantError, "%U: host RAM cache above its budget", c->name);
    Py_RETURN_NONE;
}

static PyMethodDef cache_methods[] = {
    {"n_hbm", (PyCFunction)cache_n_hbm, METH_NOARGS, NULL},
    {"n_pinned", (PyCFunction)cache_n_pinned, METH_NOARGS, NULL},
    {"pin_count", (PyCFunction)cache_pin_count, METH_O, NULL},
    {"lead", (PyCFunction)cache_lead, METH_O, NULL},
    {"lead_pinned", (PyCFunction)cache_lead_pinned, METH_O, NULL},
    {"host_lead", (PyCFunction)cache_host_lead, METH_O, NULL},
    {"locate", (PyCFunction)cache_locate, METH_VARARGS, NULL},
    {"pending_run", (PyCFunction)cache_pending_run, METH_VARARGS, NULL},
    {"insert", (PyCFunction)(void (*)(void))cache_insert, METH_VARARGS | METH_KEYWORDS, NULL},
    {"touch", (PyCFunction)cache_touch, METH_VARARGS, NULL},
    {"promote", (PyCFunction)cache_promote, METH_VARARGS, NULL},
    {"insert_arrived", (PyCFunction)cache_insert_arrived, METH_VARARGS, NULL},
    {"expect", (PyCFunction)cache_expect, METH_VARARGS, NULL},
    {"expect_copy", (PyCFunction)cache_expect_copy, METH_VARARGS, NULL},
    {"fit", (PyCFunction)cache_fit, METH_NOARGS, NULL},
    {"pin", (PyCFunction)cache_pin, METH_VARARGS, NULL},
    {"insert_pinned", (PyCFunction)cache_insert_pinned, METH_VARARGS, NULL},
    {"unpin", (PyCFunction)cache_unpin, METH_VARARGS, NULL},
    {"in_ram", (PyCFunction)cache_in_ram, METH_O, NULL},
    {"drop", (PyCFunction)cache_drop, METH_O, NULL},
    {"demote", (PyCFunction)cache_demote, METH_O, NULL},
    {"snapshot", (PyCFunction)cache_snapshot, METH_NOARGS, NULL},
    {"check", (PyCFunction)cache_check, METH_NOARGS, NULL},
    {NULL},
};

static PyMemberDef cache_members[] = {
    {"name", T_OBJECT_EX, offsetof(Cache, name), READONLY, NULL},
    {"disk", T_OBJECT, offsetof(Cache, disk), READONLY, NULL},
    {"cap_tokens", T_LONGLONG, offsetof(Cache, cap_tokens), READONLY, NULL},
    {"block_tokens", T_LONGLONG, offsetof(Cache, block_tokens), READONLY, NULL},
    {"ram_cap_blocks", T_LONGLONG, offsetof(Cache, ram_cap_blocks), READONLY, NULL},
    {"cache_whole", T_BOOL, offsetof(Cache, cache_whole), READONLY, NULL},
    {"reserved", T_LONGLONG, offsetof(Cache, reserved), 0, NULL},
    {"pinned_tokens", T_LONGLONG, offsetof(Cache, pinned_tokens), READONLY, NULL},
    {"stale_pending", T_BOOL, offsetof(Cache, stale_pending), READONLY, NULL},
    {NULL},
};

static PyTypeObject CacheType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "btb_lab.sim._cachec.PrefixCache",
    .tp_doc = PyDoc_STR("The compiled PrefixCache (see btb_lab/sim/cache.py for the rules)."),
    .tp_basicsize = sizeof(Cache),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)cache_init,
    .tp_dealloc = (destructor)cache_dealloc,
    .tp_methods = cache_methods,
    .tp_members = cache_members,
};

/* ------------------------------------------------------------------ RoutedBlocks */
/* What a walk over a prefix learnt, kept per prefix: a burst's requests ask every instance
 * about the same prefix and note it on one, several bursts at once, so walking it block by
 * block each time would repeat the same work. Each prefix's questions find their memo by
 * their first item's address; a memo is matched by identity of items.
 *
 * `lead`: the memo's tuple, its answer `n`, the entry `cur` of its last block held, and
 * the view's `version` then. A question whose items begin as the memo's is answered at
 * once while the instance's blocks stay the same, and otherwise goes on from where the
 * shared items and the memo's answer end, since blocks only added lengthen leads.
 *
 * `note`: the first `s_n` items of the memo's tuple are, in order, a stretch of the LRU
 * list no other memo's blocks are in (entries `s_first`..`s_last`, each stamped `s_stamp`
 * in its `rprev`, unused by this LRU). Noting a tuple that begins with them moves them as
 * one run without a walk (run_move would find each right after the one before); a
 * stretch is cut back to the items a question shares by following `hprev`.
 *
 * Each entry a memo holds has its `mark` (the memo's slot and generation, `memo_mark`),
 * or MARK_SHARED when memos of two slots hold it. A memo is dropped when a block it holds
 * drops out (all of them for a shared block); a stretch is dropped when another memo's
 * walk, or a note, reaches one of its blocks. */
#define MEMO_BITS 3
#define MEMO_SLOTS (1 << MEMO_BITS)
#define MEMO_GENS (1 << 27) /* memo_mark stays a positive int32 */
#define MARK_SHARED (-2)
#define STRETCH_BACK 16 /* a stretch is cut back this many blocks at most, else dropped */
typedef struct {
    PyObject *tuple; /* owned; NULL: none */
    Py_ssize_t n, s_n;
    int32_t cur, gen; /* `gen`: bumped when the memo is dropped or begun anew */
    int32_t s_first, s_last, s_stamp;
    uint64_t version;
} Memo;

typedef struct {
    PyObject_HEAD
    Table t;
    List lru;
    long long cap_blocks;
    Memo memo[MEMO_SLOTS];
    int32_t stamps;   /* the last stretch stamp given out */
    uint64_t version; /* bumped when a block is added or dropped */
} Routed;

static inline int32_t memo_mark(Routed *r, int k) { return r->memo[k].gen * MEMO_SLOTS + k; }

/* Memo `k` is dropped; the marks of its walks no longer count. */
static void memo_forget(Routed *r, int k) {
    Py_CLEAR(r->memo[k].tuple);
    r->memo[k].s_n = 0;
    r->memo[k].gen = (r->memo[k].gen + 1) % MEMO_GENS;
}

static void routed_forget(Routed *r) {
    for (int k = 0; k < MEMO_SLOTS; k++) memo_forget(r, k);
}

/* An entry with `mark` drops out: the memos that held it are dropped. */
static inline void forget_holders(Routed *r, int32_t mark) {
    if (mark == MARK_SHARED) {
        routed_forget(r);
    } else if (mark >= 0 && mark == memo_mark(r, mark % MEMO_SLOTS)) {
        memo_forget(r, mark % MEMO_SLOTS);
    }
}

/* Entry `e` is reached by a walk of the memo marked `mine` (-1: a walk no memo keeps,
 * which only moves blocks). Another memo holding it loses its stretch, and shares the
 * entry when `mine` keeps it too. 0 when the entry is shared. */
static inline int memo_reach(Routed *r, Entry *e, int32_t mine) {
    int32_t m = e->mark;
    if (m == mine) return 1;
    if (m == MARK_SHARED) return 0;
    if (m >= 0 && m == memo_mark(r, m % MEMO_SLOTS)) { /* another memo's, alive */
        r->memo[m % MEMO_SLOTS].s_n = 0;
        if (mine < 0) return 1;
        e->mark = MARK_SHARED;
        return 0;
    }
    if (mine >= 0) e->mark = mine;
    return 1;
}

/* Memo `m`'s stretch cut to its first `keep` items. */
static inline void stretch_cut(Table *t, Memo *m, Py_ssize_t keep) {
    if (keep >= m->s_n) return;
    if (keep <= 0 || m->s_n - keep > STRETCH_BACK) {
        m->s_n = 0;
        return;
    }
    int32_t last = m->s_last;
    for (Py_ssize_t k = m->s_n; k > keep; k--) last = t->e[last].hprev;
    m->s_last = last;
    m->s_n = keep;
}

/* How many leading items `s` shares (by identity) with memo `m`'s tuple, up to `limit`. */
static inline Py_ssize_t memo_same(Memo *m, Seq *s, Py_ssize_t limit) {
    PyObject **a = s->items, **b = &PyTuple_GET_ITEM(m->tuple, 0);
    Py_ssize_t n = Py_MIN(Py_MIN(s->len, PyTuple_GET_SIZE(m->tuple)), limit), same = 0;
    while (same < n && a[same] == b[same]) same++;
    return same;
}

static int routed_init(Routed *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"cap_blocks", NULL};
    long long cap;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "L", kwlist, &cap)) return -1;
    if (self->t.e == NULL && table_init(&self->t) < 0) return -1;
    self->cap_blocks = cap;
    self->lru.head = self->lru.tail = NONE_I;
    self->lru.n = 0;
    routed_forget(self);
    self->version++;
    return 0;
}

static void routed_dealloc(Routed *self) {
    routed_forget(self);
    table_free(&self->t);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The noted blocks become the most recent in order (see Run), the oldest drop out. */
static PyObject *routed_note(Routed *r, PyObject *obj) {
    Seq s;
    if (seq_open(&s, obj) < 0) return NULL;
    Table *t = &r->t;
    int32_t cur = NONE_I;
    Run run = RUN_EMPTY;
    int changed = 0;
    /* a tuple's blocks, none twice and none another memo holds, become its memo's stretch */
    int keep = PyTuple_CheckExact(obj) && s.len > 0, own = keep;
    int slot = keep ? address_bits(s.items[0], MEMO_BITS) : 0;
    Memo *memo = &r->memo[slot];
    int32_t mine = -1, stamp = 0;
    Py_ssize_t k = 0;
    if (keep) {
        if (memo->tuple != NULL && memo->s_n > 0) {
            stretch_cut(t, memo, memo_same(memo, &s, memo->s_n));
            if (memo->s_n > 0) { /* its stretch moves as the run so far */
                k = memo->s_n;
                run.first = memo->s_first;
                run.last = cur = memo->s_last;
                stamp = memo->s_stamp;
            }
        }
        if (k == 0) { /* begun anew */
            memo_forget(r, slot);
            r->stamps = r->stamps == INT32_MAX ? 0 : r->stamps + 1;
            stamp = r->stamps;
        }
        mine = memo_mark(r, slot);
    }
    for (; k < s.len; k++) {
        int32_t live = t->n_live;
        int32_t i = walk(t, s.items[k], &cur, 1);
        if (i < 0) goto fail;
        int linked = t->n_live == live;
        Entry *e = &t->e[i];
        if (!linked) { /* a new block */
            changed = 1;
            e->flags |= F_HBM;
        }
        if (!memo_reach(r, e, mine)) own = 0;
        if (keep) {
            if (e->rprev == stamp) own = 0; /* twice in this tuple (or stamped before) */
            e->rprev = stamp;
        }
        run_move(t, &r->lru, &run, i, linked);
    }
    seq_close(&s);
    run_to_newest(t, &r->lru, &run);
    while (r->lru.n > r->cap_blocks) {
        int32_t old = r->lru.head;
        UNLINK(t, old, hprev, hnext, &r->lru);
        forget_holders(r, t->e[old].mark);
        t->e[old].flags = 0;
        table_release(t, old);
        changed = 1;
    }
    r->version += changed;
    if (keep) {
        if (own && mine == memo_mark(r, slot)) { /* every block held, none dropped since */
            Py_INCREF(obj);
            Py_XSETREF(memo->tuple, obj);
            memo->n = memo->s_n = s.len;
            memo->cur = memo->s_last = run.last;
            memo->s_first = run.first;
            memo->s_stamp = stamp;
            memo->version = r->version;
        } else {
            memo->s_n = 0;
        }
    }
    Py_RETURN_NONE;
fail:
    seq_close(&s);
    run_to_newest(t, &r->lru, &run);
    if (keep) memo->s_n = 0;
    r->version++; /* blocks may have been added before the error */
    return NULL;
}

static PyObject *routed_lead(Routed *r, PyObject *obj) {
    Seq s;
    if (seq_open(&s, obj) < 0) return NULL;
    if (s.len == 0) {
        seq_close(&s);
        return PyLong_FromSsize_t(0);
    }
    int store = PyTuple_CheckExact(obj); /* only a tuple: its items cannot change under a memo */
    int slot = address_bits(s.items[0], MEMO_BITS);
    Memo *memo = &r->memo[slot];
    Py_ssize_t n = 0, same = 0;
    int32_t cur = NONE_I, held = NONE_I;
    if (memo->tuple != NULL) {
        same = memo_same(memo, &s, PY_SSIZE_T_MAX);
        if (memo->version == r->version && (memo->n < same || (same == s.len && memo->n >= same))) {
            /* the block the memo's walk stopped at is asked again and still absent, or
             * every block asked was held then and still is */
            Py_ssize_t answer = Py_MIN(memo->n, s.len);
            seq_close(&s);
            return PyLong_FromSsize_t(answer);
        }
        /* the memo's held blocks are all still here */
        n = Py_MIN(same, memo->n);
        if (n == memo->n) cur = held = memo->cur;
    }
    if (store && n == 0) memo_forget(r, slot); /* begun anew */
    int32_t mine = store ? memo_mark(r, slot) : -1;
    for (; n < s.len; n++) {
        int32_t i = walk(&r->t, s.items[n], &cur, 0);
        if (i == -2) goto fail;
        if (i == NONE_I) break;
        if (store) memo_reach(r, &r->t.e[i], mine);
        held = i;
    }
    if (store) {
        if (memo->tuple != NULL) stretch_cut(&r->t, memo, same); /* the items kept */
        Py_INCREF(obj);
        Py_XSETREF(memo->tuple, obj);
        memo->n = n;
        memo->cur = held;
        memo->version = r->version;
    }
    seq_close(&s);
    return PyLong_FromSsize_t(n);
fail:
    seq_close(&s);
    return NULL;
}

static PyMethodDef routed_methods[] = {
    {"note", (PyCFunction)routed_note, METH_O, NULL},
    {"lead", (PyCFunction)routed_lead, METH_O, NULL},
    {NULL},
};

static PyMemberDef routed_members[] = {
    {"cap_blocks", T_LONGLONG, offsetof(Routed, cap_blocks), READONLY, NULL},
    {NULL},
};

static PyTypeObject RoutedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "btb_lab.sim._cachec.RoutedBlocks",
    .tp_doc = PyDoc_STR("The compiled RoutedBlocks (see btb_lab/sim/cache.py)."),
    .tp_basicsize = sizeof(Routed),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)routed_init,
    .tp_dealloc = (destructor)routed_dealloc,
    .tp_methods = routed_methods,
    .tp_members = routed_members,
};

/* ------------------------------------------------------------------ module */
static PyObject *mod_init(PyObject *m, PyObject *error) {
    Py_INCREF(error);
    Py_XSETREF(InvariantError, error);
    Py_RETURN_NONE;
}

static PyMethodDef mod_methods[] = {
    {"init", (PyCFunction)mod_init, METH_O, "Set the exception raised when an invariant breaks."},
    {NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_cachec", "The compiled prefix cache (see btb_lab/sim/cache.py).",
    -1, mod_methods,
};

PyMODINIT_FUNC PyInit__cachec(void) {
    if (PyType_Ready(&CacheType) < 0 || PyType_Ready(&RoutedType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    InvariantError = PyExc_AssertionError;
    Py_INCREF(InvariantError);
    Py_INCREF(&CacheType);
    Py_INCREF(&RoutedType);
    if (PyModule_AddObject(m, "PrefixCache", (PyObject *)&CacheType) < 0 ||
        PyModule_AddObject(m, "RoutedBlocks", (PyObject *)&RoutedType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
