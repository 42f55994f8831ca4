/* scan_client: a C client of the scan-bridge server over ZeroMQ (protocol v1, protocol/SPEC.md).
 *
 *   scan_client ENDPOINT [VECTORS_DIR]
 *
 * 1. Decodes every golden vector in VECTORS_DIR (default: protocol/vectors, and its multipart/
 *    directory) and checks each is as valid, or as invalid, as its .json says.
 * 2. Connects a DEALER socket to ENDPOINT (e.g. ipc:///tmp/bridge.ipc, tcp://127.0.0.1:5555)
 *    and sends `ping`.
 * 3. Sends a `scan` on fresh random data twice: tensors inline in the msgpack body, then as raw
 *    buffers of a multipart message (zero copy both ways); between them, a Mamba-2 `ssd_scan`
 *    (inline). Checks each y against a scalar C reference and prints the server's timing split
 *    beside the client's round trip.
 *
 * Exits 0 when everything matched, 1 on any mismatch or failure, 2 on bad usage.
 * Assumes a little-endian host (the wire's byte order for tensor data).
 */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <msgpack.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

/* Tensor bytes travel little-endian (SPEC §5) and this client reads and writes them in place, in
 * the host's byte order, so it must not build for a big-endian host. GCC and Clang define these
 * macros; with another compiler, check the byte order some other way. */
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "scan_client needs a little-endian host: it uses tensor bytes in the host's byte order"
#endif

#ifndef REPLY_TIMEOUT_MS  /* a test builds the client with a shorter wait */
#define REPLY_TIMEOUT_MS 60000
#endif
/* fp32 against a double reference, as the Python tests compare (mamba_ssm's fp32 tolerances). */
#define RTOL 3e-4
#define ATOL 1e-3
/* SPEC §5 bounds a reply's raw buffers by its tensors alone: every tensor of the result, at any
 * depth (a model's state is two a layer, and each of `frames`' results has its own). So parts are
 * kept in arrays that grow as they come, up to this cap, which keeps a peer from making the
 * client hold frames without end: room for a 64-layer model's state in each of 500 frames. */
#define MAX_PARTS 65536
/* How deep below args, result, error or timing check_values looks: one MAX_DEPTH levels down is
 * checked, anything deeper refused rather than left unchecked (SPEC §3 leaves a decoder its own
 * nesting limit). The deepest an op nests a tensor is 4: frames, [i], state, then the tensor. */
#define MAX_DEPTH 16
#define STRING(x) #x
#define STRINGIFY(x) STRING(x)  /* a macro's value as a string literal */
/* SPEC §5: a dimension is at most 2^63 − 1 (an int64 on the server), and so is a shape's
 * extent in bytes (its dims, each 0 counted as 1, times the itemsize). */
#define MAX_EXTENT ((uint64_t)INT64_MAX)
/* The most of a timing key printed: keys name stages (SPEC §8), and a str may be up to 4 GiB. */
#define MAX_PRINTED_KEY 64

static int failures = 0;

static void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "FAIL: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    failures++;
}

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

/* -- msgpack reading helpers ------------------------------------------------------------- */

static int key_is(const msgpack_object *key, const char *name) {
    size_t n = strlen(name);
    return key->type == MSGPACK_OBJECT_STR && key->via.str.size == n && memcmp(key->via.str.ptr, name, n) == 0;
}

/* The value under `name` in a map, or NULL. */
static const msgpack_object *get(const msgpack_object *map, const char *name) {
    if (map == NULL || map->type != MSGPACK_OBJECT_MAP) return NULL;
    for (uint32_t i = 0; i < map->via.map.size; i++)
        if (key_is(&map->via.map.ptr[i].key, name)) return &map->via.map.ptr[i].val;
    return NULL;
}

static int is_str(const msgpack_object *o, const char *text) { return o != NULL && key_is(o, text); }

/* Item size of a wire dtype code, 0 when unknown. */
static size_t itemsize(const msgpack_object *dtype) {
    static const struct { const char *code; size_t size; } codes[] = {
        {"f32", 4}, {"f16", 2}, {"bf16", 2}, {"f64", 8}, {"i32", 4}, {"i64", 8}, {"u8", 1}};
    for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++)
        if (is_str(dtype, codes[i].code)) return codes[i].size;
    return 0;
}

/* One part of a message: its bytes and, in a received message, the ZeroMQ frame holding them
 * (allocated on its own: a small frame's bytes lie inside its zmq_msg_t, which must not move). */
typedef struct {
    const char *data;
    size_t size;
    zmq_msg_t *frame;
} part_t;

/* A message: the msgpack body and the raw buffers after it (a multipart message); for a request
 * being built, its raw buffers alone (send_request). */
typedef struct {
    part_t *at;
    int count, capacity;
} parts_t;

/* Appends a part, growing the array. NULL, or why it could not (the part is then not kept). */
static const char *add_part(parts_t *parts, const char *data, size_t size, zmq_msg_t *frame) {
    if (parts->count == MAX_PARTS) return "a message of more than " STRINGIFY(MAX_PARTS) " parts";
    if (parts->count == parts->capacity) {
        int capacity = parts->capacity == 0 ? 16 : 2 * parts->capacity;
        if (capacity > MAX_PARTS) capacity = MAX_PARTS;
        part_t *at = realloc(parts->at, (size_t)capacity * sizeof *at);
        if (at == NULL) return "no memory for the message's parts";
        parts->at = at;
        parts->capacity = capacity;
    }
    parts->at[parts->count++] = (part_t){data, size, frame};
    return NULL;
}

/* Frees the array of parts (not what they point to). */
static void free_parts(parts_t *parts) {
    free(parts->at);
    *parts = (parts_t){.count = 0};
}

/* A decoded tensor: where its bytes are (inside the body, or a raw buffer) and how many. */
typedef struct {
    const char *bytes;
    size_t nbytes;
    uint64_t elements;
} tensor_t;

/* Checks a tensor map {dtype, shape, data | buf} against SPEC §5; NULL when valid, else why.
 * `used` (may be NULL) marks the raw buffers it names. */
static int printed_length(uint32_t size);
static void print_object(char *text, size_t size, const msgpack_object *o);

/* What read_tensor refused, with what it expected and what came (one client thread reads replies). */
static char tensor_why[200];

static const char *tensor_refused(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tensor_why, sizeof tensor_why, fmt, ap);
    va_end(ap);
    return tensor_why;
}

/* A msgpack object's type, as a refusal names what came. */
static const char *type_name(const msgpack_object *o) {
    if (o == NULL) return "nothing";
    switch (o->type) {
        case MSGPACK_OBJECT_NIL: return "nil";
        case MSGPACK_OBJECT_BOOLEAN: return "a bool";
        case MSGPACK_OBJECT_POSITIVE_INTEGER: return "an unsigned int";
        case MSGPACK_OBJECT_NEGATIVE_INTEGER: return "a negative int";
        case MSGPACK_OBJECT_FLOAT32: case MSGPACK_OBJECT_FLOAT64: return "a float";
        case MSGPACK_OBJECT_STR: return "a str";
        case MSGPACK_OBJECT_BIN: return "a bin";
        case MSGPACK_OBJECT_ARRAY: return "an array";
        case MSGPACK_OBJECT_MAP: return "a map";
        default: return "an ext";
    }
}

static const char *read_tensor(const msgpack_object *map, const parts_t *parts, unsigned char *used,
                               tensor_t *out) {
    const msgpack_object *dtype = get(map, "dtype"), *shape = get(map, "shape");
    const msgpack_object *data = get(map, "data"), *buf = get(map, "buf");
    size_t size = itemsize(dtype);
    if (size == 0) {
        const char *dtypes = "unknown dtype: expected f32, f16, bf16, f64, i32, i64 or u8, got";
        if (dtype != NULL && dtype->type == MSGPACK_OBJECT_STR)
            return tensor_refused("%s \"%.*s\"", dtypes, printed_length(dtype->via.str.size), dtype->via.str.ptr);
        return tensor_refused("%s %s", dtypes, type_name(dtype));
    }
    if (shape == NULL || shape->type != MSGPACK_OBJECT_ARRAY)
        return tensor_refused("bad shape: expected an array of at most 8 dimensions, got %s", type_name(shape));
    if (shape->via.array.size > 8)
        return tensor_refused("bad shape: expected at most 8 dimensions, got %u", shape->via.array.size);
    /* The shape's extent (SPEC §5), with checked multiplies: a product that wraps would let
     * [2^62, 4] f32 pass with 0 bytes. A zero dimension leaves no elements but counts as 1 in
     * the extent, so [0, 2^61] f32 is refused too. Within the extent, the element and byte
     * counts cannot wrap. */
    uint64_t elements = 1, extent = size;
    for (uint32_t i = 0; i < shape->via.array.size; i++) {
        const msgpack_object *dim = &shape->via.array.ptr[i];
        if (dim->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
            return tensor_refused("bad dimension %u: expected an unsigned int, got %s", i, type_name(dim));
        if (dim->via.u64 > MAX_EXTENT)
            return tensor_refused("bad dimension %u: expected at most 2^63 - 1, got %llu", i,
                                  (unsigned long long)dim->via.u64);
        if (__builtin_mul_overflow(extent, dim->via.u64 ? dim->via.u64 : 1, &extent) || extent > MAX_EXTENT)
            return "shape of more than 2^63 - 1 bytes";
        elements *= dim->via.u64;
    }
    uint64_t nbytes = elements * size;
    if ((data == NULL) == (buf == NULL) || map->via.map.size != 3) return "not exactly dtype, shape and one of data/buf";
    if (data != NULL) {
        if (data->type != MSGPACK_OBJECT_BIN && data->type != MSGPACK_OBJECT_STR)
            return tensor_refused("data neither bin nor str: got %s", type_name(data));
        out->bytes = data->via.bin.ptr;  /* bin and str share the layout {size, ptr} */
        out->nbytes = data->via.bin.size;
    } else {
        /* Not `buf + 1 >= count`: buf = 2^64 − 1 would wrap to 0 and name the body. */
        if (buf->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
            return tensor_refused("buf names no raw buffer: expected an unsigned int, got %s", type_name(buf));
        if (parts->count == 1)
            return tensor_refused("buf names no raw buffer: the frame has none after its body, got buf %llu",
                                  (unsigned long long)buf->via.u64);
        if (buf->via.u64 >= (uint64_t)parts->count - 1)
            return tensor_refused("buf names no raw buffer: expected an index below %d (the frame's raw "
                                  "buffers after its body), got %llu", parts->count - 1,
                                  (unsigned long long)buf->via.u64);
        out->bytes = parts->at[buf->via.u64 + 1].data;
        out->nbytes = parts->at[buf->via.u64 + 1].size;
        if (used) used[buf->via.u64 + 1] = 1;
    }
    out->elements = elements;
    if (out->nbytes != nbytes)
        return tensor_refused("tensor size mismatch: its shape and dtype need %llu bytes, its data holds %llu",
                              (unsigned long long)nbytes, (unsigned long long)out->nbytes);
    return NULL;
}

/* Walks the msgpack bytes of a body without unpacking them: msgpack-c allocates room for all of
 * an array's or map's elements as soon as it reads their count, so a 5-byte body announcing
 * 2^32 − 1 of them would have it reserve room for them all. Every value takes at least one
 * byte, so a count beyond the bytes left is refused here; so is anything but exactly one value.
 * It needs no stack: it counts the values still to come. NULL when the body is one value. */
static const char *scan_body(const unsigned char *p, size_t size) {
    enum { SCALAR, PAYLOAD, ARRAY, MAP };
    size_t pos = 0;
    uint64_t pending = 1;  /* values still to read */
    while (pending > 0) {
        if (pos == size) return "not one msgpack value";
        unsigned char type = p[pos++];
        pending--;
        /* After the type byte: a length or count `width` bytes wide (big-endian), then `fixed`
         * bytes, then the payload of that length (str, bin, ext). */
        int counted = SCALAR;
        uint64_t n = 0, fixed = 0, width = 0;
        if (type <= 0x7f || type >= 0xe0) counted = SCALAR;       /* positive and negative fixint */
        else if (type <= 0x8f) counted = MAP, n = type & 0x0f;     /* fixmap */
        else if (type <= 0x9f) counted = ARRAY, n = type & 0x0f;   /* fixarray */
        else if (type <= 0xbf) counted = PAYLOAD, n = type & 0x1f; /* fixstr */
        else switch (type) {
            case 0xc0: case 0xc2: case 0xc3: break;                                   /* nil, false, true */
            case 0xc4: case 0xc5: case 0xc6: counted = PAYLOAD, width = 1u << (type - 0xc4); break; /* bin */
            case 0xc7: case 0xc8: case 0xc9:                                          /* ext: + its type */
                counted = PAYLOAD, width = 1u << (type - 0xc7), fixed = 1; break;
            case 0xca: fixed = 4; break;                                              /* float 32 */
            case 0xcb: fixed = 8; break;                                              /* float 64 */
            case 0xcc: case 0xcd: case 0xce: case 0xcf: fixed = 1u << (type - 0xcc); break;  /* uint */
            case 0xd0: case 0xd1: case 0xd2: case 0xd3: fixed = 1u << (type - 0xd0); break;  /* int */
            case 0xd4: case 0xd5: case 0xd6: case 0xd7: case 0xd8:                    /* fixext + its type */
                fixed = 1 + (1u << (type - 0xd4)); break;
            case 0xd9: case 0xda: case 0xdb: counted = PAYLOAD, width = 1u << (type - 0xd9); break; /* str */
            case 0xdc: case 0xdd: counted = ARRAY, width = 2u << (type - 0xdc); break;
            case 0xde: case 0xdf: counted = MAP, width = 2u << (type - 0xde); break;
            default: return "not one msgpack value";                                 /* 0xc1: never used */
        }
        if (width > size - pos) return "not one msgpack value";
        for (uint64_t i = 0; i < width; i++) n = n << 8 | p[pos++];
        if (counted == PAYLOAD) fixed += n;
        if (fixed > size - pos) return "not one msgpack value";
        pos += fixed;
        if (counted == ARRAY || counted == MAP) {
            uint64_t values = counted == MAP ? 2 * n : n;  /* a map entry is a key and a value */
            if (values > size - pos || pending + values > size - pos)
                return "an array or map of more elements than the body has bytes";
            pending += values;
        }
    }
    if (pos != size) return "bytes after the msgpack value";
    return NULL;
}

/* The body of a message: exactly one msgpack map. NULL when it is one, else why not. */
static const char *unpack_body(const parts_t *parts, msgpack_unpacked *result) {
    size_t offset = 0;
    if (parts->count == 0) return "no body";
    const char *why = scan_body((const unsigned char *)parts->at[0].data, parts->at[0].size);
    if (why) return why;  /* checked before msgpack-c allocates anything for it */
    msgpack_unpack_return unpacked = msgpack_unpack_next(result, parts->at[0].data, parts->at[0].size, &offset);
    /* msgpack-c unpacks maps and arrays 32 deep at most, and says NOMEM of one deeper too. */
    if (unpacked == MSGPACK_UNPACK_NOMEM_ERROR)
        return "values nested more than msgpack-c's 32 levels, or no memory to unpack them";
    if (unpacked != MSGPACK_UNPACK_SUCCESS) return "not one msgpack value";
    if (offset != parts->at[0].size) return "bytes after the msgpack value";
    if (result->data.type != MSGPACK_OBJECT_MAP) return "not a map";
    return NULL;
}

/* Whether the n bytes at s are UTF-8 (RFC 3629: no overlong forms, no surrogates, nothing past
 * U+10FFFF), as SPEC §3 wants every str but tensor data. */
static int utf8_valid(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned char c = s[i];
        size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
        if (len == 0 || len > n - i) return 0;
        uint32_t cp = len == 1 ? c : c & (0x7F >> len);
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return 0;
            cp = cp << 6 | (s[i + k] & 0x3F);
        }
        static const uint32_t least[5] = {0, 0, 0x80, 0x800, 0x10000};
        if (cp < least[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
        i += len;
    }
    return 1;
}

static int compare_keys(const void *a, const void *b) {
    const msgpack_object_str *x = *(const msgpack_object_str *const *)a, *y = *(const msgpack_object_str *const *)b;
    if (x->size != y->size) return x->size < y->size ? -1 : 1;
    return memcmp(x->ptr, y->ptr, x->size);
}

/* SPEC §3: a map's keys are UTF-8 strs, each once. NULL when they are, else why not. */
static const char *check_keys(const msgpack_object *map) {
    uint32_t n = map->via.map.size;
    if (n == 0) return NULL;
    const msgpack_object_str **keys = malloc(n * sizeof *keys);
    if (keys == NULL) return "no memory to check a map's keys";
    const char *why = NULL;
    for (uint32_t i = 0; i < n && !why; i++) {
        const msgpack_object *key = &map->via.map.ptr[i].key;
        if (key->type != MSGPACK_OBJECT_STR) why = "a map key that is not a str";
        else if (!utf8_valid((const unsigned char *)key->via.str.ptr, key->via.str.size)) why = "a map key that is not UTF-8";
        else keys[i] = &key->via.str;
    }
    if (!why) {
        qsort(keys, n, sizeof *keys, compare_keys);
        for (uint32_t i = 1; i < n && !why; i++)
            if (compare_keys(&keys[i - 1], &keys[i]) == 0) why = "a map key given twice";
    }
    free(keys);
    return why;
}

/* Whether a value is a tensor's map (SPEC §5): one with a shape and data or buf, as the Python
 * client tells one (protocol/decode.py). */
static int is_tensor(const msgpack_object *value) {
    return get(value, "shape") && (get(value, "data") || get(value, "buf"));
}

/* Checks `value`, which lies `depth` levels below args, result, error or timing: every map's keys
 * UTF-8 strs, each once, and every other str UTF-8 (SPEC §3); a map with a shape and data or buf
 * is a tensor, held to all of SPEC §5 (a dtype, no other key, ...; its data may be a str of any
 * bytes), as the Python client holds it (protocol/decode.py); any other map, and an array, is
 * looked through, since a message carries tensors at any depth (SPEC §5: a model's state map,
 * each of `frames`' results). A dtype alone makes no tensor: model_load's config is a
 * transformers config, whose "dtype" is "float32", and tensor_size_mismatch's detail has dtype
 * and shape keys. `used` marks the raw buffers they name. NULL when all are valid. */
static const char *check_nested(const msgpack_object *value, const parts_t *parts, unsigned char *used,
                                int depth) {
    if (value->type == MSGPACK_OBJECT_STR)
        return utf8_valid((const unsigned char *)value->via.str.ptr, value->via.str.size) ? NULL : "a str that is not UTF-8";
    if (value->type == MSGPACK_OBJECT_EXT) return "an ext type (the protocol has none)";
    int is_map = value->type == MSGPACK_OBJECT_MAP;
    const char *why = is_map ? check_keys(value) : NULL;
    if (why) return why;
    if (is_tensor(value)) {
        tensor_t t;
        return read_tensor(value, parts, used, &t);
    }
    uint32_t n = is_map ? value->via.map.size : value->type == MSGPACK_OBJECT_ARRAY ? value->via.array.size : 0;
    if (n > 0 && depth == MAX_DEPTH)
        return "values nested more than " STRINGIFY(MAX_DEPTH) " levels below args, result, error or timing";
    for (uint32_t i = 0; i < n; i++) {
        why = check_nested(is_map ? &value->via.map.ptr[i].val : &value->via.array.ptr[i], parts, used, depth + 1);
        if (why) return why;
    }
    return NULL;
}

/* Checks the values of an unpacked message (check_nested), and that each raw buffer is named by
 * a tensor. They lie under a request's `args` and a reply's `result`, `error` and `timing`
 * (SPEC §4 to §6); the envelope's own values check_envelope checks. A holder's own keys are
 * checked, but it is no tensor itself: args' dtype is a weights dtype (model_load). A reply's
 * holder with a tensor's keys is read as one, as decode_reply reads every value of a reply,
 * the holder ok does not name too (check_envelope refuses a tensor as the one it names). NULL
 * when all are valid, else why not. */
static const char *check_values(const msgpack_object *message, const parts_t *parts) {
    static const char *const holders[] = {"args", "result", "error", "timing"};
    unsigned char *used = calloc((size_t)parts->count + 1, 1);
    const char *why = used ? NULL : "no memory to check the raw buffers";
    for (size_t h = 0; h < sizeof holders / sizeof holders[0] && !why; h++) {
        const msgpack_object *values = get(message, holders[h]);
        if (values && h > 0 && is_tensor(values)) {
            why = check_nested(values, parts, used, 0);
            continue;
        }
        if (values && values->type == MSGPACK_OBJECT_MAP) why = check_keys(values);
        for (uint32_t i = 0; values && values->type == MSGPACK_OBJECT_MAP && i < values->via.map.size && !why; i++)
            why = check_nested(&values->via.map.ptr[i].val, parts, used, 1);
    }
    for (int i = 1; i < parts->count && !why; i++)
        if (!used[i]) why = "a raw buffer no tensor names";
    free(used);
    return why;
}

/* Decodes a message as a client would: one msgpack map filling the body, every tensor valid,
 * every raw buffer named. NULL when it decodes, else why not. */
static const char *decode_message(const parts_t *parts, msgpack_unpacked *result) {
    const char *why = unpack_body(parts, result);
    return why ? why : check_values(&result->data, parts);
}

/* Checks a reply's envelope (SPEC §3, §4) by the rules of the Python client (decode_reply in
 * protocol/decode.py), so that the two accept the same replies: every key one of the six a reply
 * has, none twice (get() would take the first and ignore the rest); v, id and ok present; v the
 * version this client speaks; id nil, a uint or a non-empty str; ok a bool; result (when ok) or
 * error (when not) a map; timing, which an error reply may lack, a map; none of these a tensor's
 * map. NULL when valid. */
static const char *check_envelope(const msgpack_object *message) {
    enum { V, ID, OK, RESULT, ERROR, TIMING, KEYS };
    static const char *const names[KEYS] = {"v", "id", "ok", "result", "error", "timing"};
    const msgpack_object *value[KEYS] = {NULL};
    for (uint32_t i = 0; i < message->via.map.size; i++) {
        const msgpack_object_kv *entry = &message->via.map.ptr[i];
        int k = 0;
        while (k < KEYS && !key_is(&entry->key, names[k])) k++;
        if (k == KEYS) return "a key other than v, id, ok, result, error and timing";
        if (value[k] != NULL) return "a key given twice";
        value[k] = &entry->val;
    }
    const msgpack_object *v = value[V], *id = value[ID], *ok = value[OK];
    if (v == NULL) return "no v";
    if (id == NULL) return "no id";
    if (ok == NULL) return "no ok";
    if (v->type != MSGPACK_OBJECT_POSITIVE_INTEGER || v->via.u64 != 1) return "v is not 1";
    if (id->type != MSGPACK_OBJECT_NIL && id->type != MSGPACK_OBJECT_POSITIVE_INTEGER &&
        (id->type != MSGPACK_OBJECT_STR || id->via.str.size == 0))
        return "id neither nil, a uint nor a non-empty str";
    if (id->type == MSGPACK_OBJECT_STR && !utf8_valid((const unsigned char *)id->via.str.ptr, id->via.str.size))
        return "id a str that is not UTF-8";
    if (ok->type != MSGPACK_OBJECT_BOOLEAN) return "ok is not a bool";
    if (ok->via.boolean && (value[RESULT] == NULL || value[RESULT]->type != MSGPACK_OBJECT_MAP))
        return "result is not a map";
    if (!ok->via.boolean && (value[ERROR] == NULL || value[ERROR]->type != MSGPACK_OBJECT_MAP))
        return "error is not a map";
    if (value[TIMING] != NULL && value[TIMING]->type != MSGPACK_OBJECT_MAP) return "timing is not a map";
    /* A tensor's map holds no values: decode_reply refuses one in their place too. */
    if (is_tensor(value[ok->via.boolean ? RESULT : ERROR]) || is_tensor(value[TIMING]))
        return "a tensor as result, error or timing, not a map of values";
    return NULL;
}

/* -- golden vectors ------------------------------------------------------------------------ */

/* Reads a regular file whole into *data (NUL-terminated) and its size into *size. NULL, or why
 * not. Not sized by ftell: it gives -1 for a pipe and LONG_MAX for a directory on ext4. */
static const char *read_file(const char *path, char **data, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return strerror(errno);
    struct stat st;
    const char *why = fstat(fileno(f), &st) != 0 ? strerror(errno) : !S_ISREG(st.st_mode) ? "not a regular file" : NULL;
    *data = why ? NULL : malloc((size_t)st.st_size + 1);
    if (!why && !*data) why = "no memory for it";
    if (!why && fread(*data, 1, (size_t)st.st_size, f) != (size_t)st.st_size) why = "read short of its size";
    fclose(f);
    if (why) {
        free(*data);
        *data = NULL;
        return why;
    }
    (*data)[st.st_size] = 0;
    *size = (size_t)st.st_size;
    return NULL;
}

/* The string value of `"key": "..."` in a JSON text, copied into out (empty when absent). */
static void json_string(const char *json, const char *key, char *out, size_t cap) {
    char pattern[64];
    snprintf(pattern, sizeof pattern, "\"%s\": \"", key);
    const char *at = strstr(json, pattern);
    out[0] = 0;
    if (!at) return;
    at += strlen(pattern);
    size_t n = 0;
    while (at[n] && at[n] != '"' && n + 1 < cap) n++;
    memcpy(out, at, n);
    out[n] = 0;
}

/* Checks one vector: what decoding finds against what its JSON says. */
static void check_vector(const char *dir, const char *name) {
    char frame_path[4096], json_path[4096], *frame = NULL, *json = NULL;
    size_t size, json_size;
    snprintf(frame_path, sizeof frame_path, "%s/%s.frame", dir, name);
    snprintf(json_path, sizeof json_path, "%s/%s.json", dir, name);
    const char *unread = frame_path, *why = read_file(frame_path, &frame, &size);
    if (!why) unread = json_path, why = read_file(json_path, &json, &json_size);
    if (why) {
        fail("vector %s: cannot read %s: %s", name, unread, why);
        free(frame);
        return;
    }
    char kind[32], code[64];
    json_string(json, "kind", kind, sizeof kind);
    json_string(json, "code", code, sizeof code);
    int legacy = strstr(json, "\"legacy\": true") != NULL;

    /* The parts, each length-prefixed (one part except in multipart/). */
    parts_t parts = {.count = 0};
    size_t pos = 0;
    while (pos < size && !why) {
        if (size - pos < 4) { why = "truncated frame header"; break; }
        const unsigned char *h = (const unsigned char *)frame + pos;
        size_t length = ((size_t)h[0] << 24) | ((size_t)h[1] << 16) | ((size_t)h[2] << 8) | h[3];
        if (length > size - pos - 4) { why = "frame longer than the stream"; break; }
        why = add_part(&parts, frame + pos + 4, length, NULL);
        pos += 4 + length;
    }
    msgpack_unpacked result;
    msgpack_unpacked_init(&result);
    if (!why) why = decode_message(&parts, &result);
    /* A reply's envelope too, as exchange checks it (an error reply's kind is "error"). */
    int reply = !strcmp(kind, "reply") || !strcmp(kind, "multipart_reply") || !strcmp(kind, "error");
    if (!why && reply) why = check_envelope(&result.data);

    /* Decoding finds malformed bytes and tensors; the server alone finds the rest (an unknown
     * op, a missing argument, a wrong version, legacy key rules). */
    int client_detects = strcmp(kind, "invalid_frame") == 0 ||
        (strcmp(kind, "invalid") == 0 && !legacy &&
         (!strcmp(code, "decode_error") || !strcmp(code, "tensor_size_mismatch") || !strcmp(code, "unknown_dtype")));
    if (client_detects && !why)
        fail("vector %s (%s %s): decoded, but it is malformed", name, kind, code);
    else if (!client_detects && why)
        fail("vector %s (%s): %s", name, kind, why);
    else
        printf("vector %-28s %-18s %s%s\n", name, kind, why ? "rejected: " : "decoded", why ? why : "");
    msgpack_unpacked_destroy(&result);
    free_parts(&parts);
    free(frame);
    free(json);
}

static int is_frame(const struct dirent *entry) {
    size_t n = strlen(entry->d_name);
    return n > 6 && strcmp(entry->d_name + n - 6, ".frame") == 0;
}

/* Checks every vector in dir, in name order; how many, or -1 when dir cannot be listed. */
static int check_vectors_in(const char *dir) {
    struct dirent **entries;
    int count = scandir(dir, &entries, is_frame, alphasort);
    if (count < 0) return -1;
    for (int i = 0; i < count; i++) {
        entries[i]->d_name[strlen(entries[i]->d_name) - 6] = 0;  /* the vector's name: no .frame */
        check_vector(dir, entries[i]->d_name);
        free(entries[i]);
    }
    free(entries);
    return count;
}

/* -- talking to the server ----------------------------------------------------------------- */

/* A reply: its parts, each in the frame ZeroMQ received it in, and its body unpacked. */
typedef struct {
    parts_t parts;
    msgpack_unpacked body;
    double round_trip_us;
} reply_t;

static void close_frames(reply_t *reply) {
    for (int i = 0; i < reply->parts.count; i++) {
        zmq_msg_close(reply->parts.at[i].frame);
        free(reply->parts.at[i].frame);
    }
    free_parts(&reply->parts);
}

static void close_reply(reply_t *reply) {
    msgpack_unpacked_destroy(&reply->body);
    close_frames(reply);
}

/* ZeroMQ's callback for a zero-copy frame's bytes: it calls it when it is done with them, which
 * can be long after the send returned (its I/O thread writes them out when the peer reads). */
static void free_buffer(void *data, void *hint) {
    (void)hint;
    free(data);
}

/* Sends the body (copied) and the raw buffers (zero copy) as one message; 0 on success. The
 * buffers must come from malloc, each its own allocation given once (one array passed for two
 * tensors would be freed twice), and are ZeroMQ's from then on, sent or not: it frees them
 * (free_buffer) when it is done, and this frees those it never took. The caller must not touch
 * them again: freeing them itself, even after a reply or a timeout, could pull them from under
 * a send still in progress. A send that fails after the body went out leaves the socket inside
 * a message that its next send would extend: a client must close the socket then (here the
 * multipart scan, the only request with buffers, is also the last). */
static int send_request(void *sock, const msgpack_sbuffer *body, const parts_t *buffers) {
    int sent = zmq_send(sock, body->data, body->size, buffers->count > 0 ? ZMQ_SNDMORE : 0) >= 0;
    int error = sent ? 0 : zmq_errno();
    for (int i = 0; i < buffers->count; i++) {
        void *data = (void *)buffers->at[i].data;
        zmq_msg_t msg;
        if (!sent || zmq_msg_init_data(&msg, data, buffers->at[i].size, free_buffer, NULL) != 0) {
            if (sent) error = zmq_errno(), sent = 0;
            free(data);
        } else if (zmq_msg_send(&msg, sock, i + 1 < buffers->count ? ZMQ_SNDMORE : 0) < 0) {
            error = zmq_errno(), sent = 0;
            zmq_msg_close(&msg);  /* a message that was not sent is still ours: this frees data */
        }
    }
    errno = error;
    return sent ? 0 : -1;
}

/* Receives one part into msg by `deadline` (now_us()'s clock); 0, or -1 with zmq_errno() set
 * (EAGAIN: the deadline passed). A signal's EINTR (libzmq gives it whatever SA_RESTART says) is
 * a wait to go on with, on the time left. */
static int receive_part(void *sock, zmq_msg_t *msg, double deadline) {
    for (;;) {
        double left_ms = (deadline - now_us()) / 1000;
        int timeout = left_ms > 0 ? (int)left_ms : 0;
        zmq_setsockopt(sock, ZMQ_RCVTIMEO, &timeout, sizeof timeout);
        if (zmq_msg_recv(msg, sock, 0) >= 0) return 0;
        if (zmq_errno() != EINTR) return -1;
    }
}

/* Receives one whole message into reply->parts by `deadline`. One of more than MAX_PARTS
 * parts, or one memory runs out for, is read to its end and dropped, so that its rest is not
 * taken for the next message. NULL on success, else why not, with no frame left open. */
static const char *receive_message(void *sock, reply_t *reply, double deadline) {
    const char *dropped = NULL;  /* why the message is being read to its end and dropped */
    int more = 1;
    reply->parts = (parts_t){.count = 0};
    while (more) {
        zmq_msg_t spare, *msg = dropped ? NULL : malloc(sizeof *msg);
        if (msg == NULL && !dropped) dropped = "no memory for the message's parts";
        if (msg == NULL) msg = &spare;
        zmq_msg_init(msg);
        if (receive_part(sock, msg, deadline) != 0) {
            /* EAGAIN is the deadline passing: zmq_strerror would say "Resource temporarily
             * unavailable" of a server that never answered. */
            const char *why = zmq_errno() == EAGAIN ? "none came within " STRINGIFY(REPLY_TIMEOUT_MS) " ms"
                                                    : zmq_strerror(zmq_errno());
            zmq_msg_close(msg);
            if (msg != &spare) free(msg);
            close_frames(reply);
            return why;
        }
        more = zmq_msg_more(msg);
        if (msg == &spare) {
            zmq_msg_close(msg);
        } else if ((dropped = add_part(&reply->parts, zmq_msg_data(msg), zmq_msg_size(msg), msg)) != NULL) {
            zmq_msg_close(msg);
            free(msg);
        }
    }
    if (dropped) {
        close_frames(reply);
        return dropped;
    }
    return NULL;
}

/* Sends a request (see send_request for the buffers) and waits for its reply: the first reply
 * whose id is `id`, an ok one, with valid tensors. 1 when it came, and then the caller closes
 * it (close_reply); else 0, after saying why (fail). A reply whose envelope is malformed fails,
 * whatever its id: with a key twice, say, which request it answers is unclear. Replies are
 * matched by id (SPEC §1): one with another id answers some other request (a late reply to one
 * that timed out, say) and is dropped, never taken for this one's. The reply has REPLY_TIMEOUT_MS
 * from the send to come, however many replies to others come meanwhile. */
static int exchange(void *sock, const char *what, uint64_t id, const msgpack_sbuffer *body,
                    const parts_t *buffers, reply_t *reply) {
    double start = now_us(), deadline = start + REPLY_TIMEOUT_MS * 1000.0;
    int others = 0;  /* replies to other ids dropped while waiting */
    if (send_request(sock, body, buffers) != 0) {
        fail("%s: not sent: %s", what, zmq_strerror(errno));
        return 0;
    }
    for (;;) {
        const char *why = receive_message(sock, reply, deadline);
        if (why && others) {
            fail("%s: no reply: %s (%d replies to other requests dropped meanwhile)", what, why, others);
            return 0;
        }
        if (why) {
            fail("%s: no reply: %s", what, why);
            return 0;
        }
        reply->round_trip_us = now_us() - start;
        msgpack_unpacked_init(&reply->body);
        const msgpack_object *message = &reply->body.data;
        if ((why = unpack_body(&reply->parts, &reply->body)) != NULL) {
            fail("%s: a reply that does not decode (%s)", what, why);
            break;
        }
        if ((why = check_envelope(message)) != NULL) {  /* before its id is trusted to match */
            fail("%s: a malformed reply (%s)", what, why);
            break;
        }
        const msgpack_object *reply_id = get(message, "id"), *ok = get(message, "ok");
        char text[512];
        if (reply_id->type == MSGPACK_OBJECT_NIL) {
            /* The server could not read some request's id (SPEC §4: undecodable, too large, ...),
             * so this answers no request by name. With one request in flight, as here, it is
             * most likely this one's answer, and waiting on would only end in the timeout; a
             * client with several in flight cannot tell, and lets their timeouts settle them. */
            print_object(text, sizeof text, message);
            fail("%s: a reply with no id, to a request the server could not read: %s", what, text);
            break;
        }
        if (reply_id->type != MSGPACK_OBJECT_POSITIVE_INTEGER || reply_id->via.u64 != id) {
            print_object(text, sizeof text, reply_id);
            fprintf(stderr, "%s: dropped a reply to id %s, not this request's id %llu\n", what, text,
                    (unsigned long long)id);
            close_reply(reply);
            others++;
            continue;
        }
        if ((why = check_values(message, &reply->parts)) != NULL) {
            fail("%s: a malformed reply (%s)", what, why);
        } else if (!ok->via.boolean) {
            const msgpack_object *error = get(message, "error");
            print_object(text, sizeof text, error ? error : message);
            fail("%s: an error reply: %s", what, text);
        } else {
            return 1;
        }
        break;
    }
    close_reply(reply);
    return 0;
}

static void pack_string(msgpack_packer *pk, const char *s) { msgpack_pack_str_with_body(pk, s, strlen(s)); }

/* The request envelope up to the args map header. */
static void pack_envelope(msgpack_packer *pk, uint64_t id, const char *op, size_t n_args) {
    msgpack_pack_map(pk, 4);
    pack_string(pk, "v");
    msgpack_pack_int(pk, 1);
    pack_string(pk, "id");
    msgpack_pack_uint64(pk, id);
    pack_string(pk, "op");
    pack_string(pk, op);
    pack_string(pk, "args");
    msgpack_pack_map(pk, n_args);
}

/* An f32 tensor: inline as bin (a copy), or (with buffers) as the next raw buffer of the
 * message, zero copy: `values` then goes with the message (send_request). */
static void pack_tensor(msgpack_packer *pk, const char *name, const float *values, const int *shape, int ndim,
                        parts_t *buffers) {
    size_t elements = 1;
    for (int i = 0; i < ndim; i++) elements *= (size_t)shape[i];
    pack_string(pk, name);
    msgpack_pack_map(pk, 3);
    pack_string(pk, "dtype");
    pack_string(pk, "f32");
    pack_string(pk, "shape");
    msgpack_pack_array(pk, ndim);
    for (int i = 0; i < ndim; i++) msgpack_pack_int(pk, shape[i]);
    if (buffers == NULL) {
        pack_string(pk, "data");
        msgpack_pack_bin_with_body(pk, values, elements * sizeof(float));
    } else {
        pack_string(pk, "buf");
        msgpack_pack_int(pk, buffers->count);
        const char *why = add_part(buffers, (const char *)values, elements * sizeof(float), NULL);
        if (why) {  /* out of memory for a handful of parts: nothing sensible to go on with */
            fprintf(stderr, "scan_client: %s\n", why);
            exit(1);
        }
    }
}

/* Whether msgpack-c's printer can print `o`: it prints a str (a bin, an ext) with its size cast to
 * an int, and one of 2 GiB or more was read to a NUL, past its end (as printed_length says of a
 * key). The decoder's depth limit bounds the recursion. */
static int printable(const msgpack_object *o) {
    switch (o->type) {
    case MSGPACK_OBJECT_STR: return o->via.str.size <= INT32_MAX;
    case MSGPACK_OBJECT_BIN: return o->via.bin.size <= INT32_MAX;
    case MSGPACK_OBJECT_EXT: return o->via.ext.size <= INT32_MAX;
    case MSGPACK_OBJECT_ARRAY:
        for (uint32_t i = 0; i < o->via.array.size; i++)
            if (!printable(&o->via.array.ptr[i])) return 0;
        return 1;
    case MSGPACK_OBJECT_MAP:
        for (uint32_t i = 0; i < o->via.map.size; i++)
            if (!printable(&o->via.map.ptr[i].key) || !printable(&o->via.map.ptr[i].val)) return 0;
        return 1;
    default: return 1;
    }
}

/* `o` printed into `text` by msgpack-c, or a note saying why not (printable). msgpack-c leaves
 * the buffer unterminated where a bin of printable bytes fills it: the last byte is set here. */
static void print_object(char *text, size_t size, const msgpack_object *o) {
    if (size == 0) return;
    if (printable(o)) {
        text[0] = 0;
        msgpack_object_print_buffer(text, size, *o);
        text[size - 1] = 0;
    } else {
        snprintf(text, size, "(not printed: it holds a str or bin of 2 GiB or more)");
    }
}

/* How many bytes of a timing key of `size` bytes to print with "%.*s": at most MAX_PRINTED_KEY.
 * Its precision is an int, and a str of 2 GiB or more cast to one is negative, which printf
 * takes as no precision: it read the key to a NUL, past its end. */
static int printed_length(uint32_t size) {
    return size > MAX_PRINTED_KEY ? MAX_PRINTED_KEY : (int)size;
}

/* Prints the reply's timing map and the client's view of the same request. */
static void print_timing(const char *what, const msgpack_object *reply, double round_trip_us) {
    const msgpack_object *timing = get(reply, "timing");
    double server_us = 0;
    printf("%-16s round trip %9.1f us |", what, round_trip_us);
    for (uint32_t i = 0; timing && timing->type == MSGPACK_OBJECT_MAP && i < timing->via.map.size; i++) {
        const msgpack_object *k = &timing->via.map.ptr[i].key, *v = &timing->via.map.ptr[i].val;
        double value = v->type == MSGPACK_OBJECT_FLOAT64 || v->type == MSGPACK_OBJECT_FLOAT32 ? v->via.f64
                       : v->type == MSGPACK_OBJECT_POSITIVE_INTEGER ? (double)v->via.u64 : 0;
        if (key_is(k, "server_us")) server_us = value;
        /* exchange took the reply once check_values found every key a str */
        printf(" %.*s%s=%.1f", printed_length(k->via.str.size), k->via.str.ptr,
               k->via.str.size > MAX_PRINTED_KEY ? "..." : "", value);
    }
    printf(" | ipc %.1f us\n", round_trip_us - server_us);
}

/* A fresh xorshift stream: different data on every run. */
static uint64_t rng_state;
static float uniform(float low, float high) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return low + (high - low) * (float)((rng_state >> 11) * (1.0 / 9007199254740992.0));
}

/* The reference: mamba's selective_scan_ref in double, layout bld, with D, z and softplus. */
static void reference_scan(int b, int l, int d, int n, const float *x, const float *dt, const float *A,
                           const float *B, const float *C, const float *D, const float *z, double *y) {
    double *h = calloc((size_t)d * n, sizeof *h);
    for (int bi = 0; bi < b; bi++) {
        memset(h, 0, (size_t)d * n * sizeof *h);
        for (int t = 0; t < l; t++) {
            size_t row = ((size_t)bi * l + t);
            for (int c = 0; c < d; c++) {
                double delta = dt[row * d + c];
                delta = delta > 20 ? delta : log1p(exp(delta));  /* softplus */
                double xv = x[row * d + c], acc = 0;
                for (int s = 0; s < n; s++) {
                    double *hs = &h[(size_t)c * n + s];
                    *hs = exp(delta * A[c * n + s]) * *hs + delta * B[row * n + s] * xv;
                    acc += C[row * n + s] * *hs;
                }
                acc += D[c] * xv;
                double zv = z[row * d + c];
                y[row * d + c] = acc * zv / (1 + exp(-zv));  /* y * silu(z) */
            }
        }
    }
    free(h);
}

/* Whether a tensor's `shape` (read_tensor checked it) is `dims`, `rank` of them. */
static int has_shape(const msgpack_object *shape, const int *dims, int rank) {
    if (shape->via.array.size != (uint32_t)rank) return 0;
    for (int i = 0; i < rank; i++)
        if (shape->via.array.ptr[i].via.u64 != (uint64_t)dims[i]) return 0;
    return 1;
}

/* Checks the y of an ok reply (exchange checked its tensors already) against the reference's
 * values, x's `shape` (`rank` dimensions) and the values' count, and prints the timing when they
 * agree. 1 when they do, else 0 (fail). */
static int check_y(const char *what, const reply_t *reply, const double *expected, const int *shape, int rank) {
    const msgpack_object *y = get(get(&reply->body.data, "result"), "y");
    const char *why;
    tensor_t t;
    size_t count = 1;
    for (int i = 0; i < rank; i++) count *= (size_t)shape[i];
    if (!y) {
        fail("%s: the reply has no y", what);
        return 0;
    }
    if ((why = read_tensor(y, &reply->parts, NULL, &t)) != NULL || !is_str(get(y, "dtype"), "f32")) {
        fail("%s: y is not %zu f32 values (%s)", what, count, why ? why : "wrong dtype");
        return 0;
    }
    if (!has_shape(get(y, "shape"), shape, rank)) {
        char text[128];
        print_object(text, sizeof text, get(y, "shape"));
        fail("%s: y's shape is not x's (got %s)", what, text);
        return 0;
    }
    size_t bad = 0, worst_at = 0;
    double worst = 0;
    for (size_t i = 0; i < count; i++) {
        float got;
        memcpy(&got, t.bytes + i * 4, 4);  /* payloads need not be aligned */
        double error = fabs(got - expected[i]);
        /* written so that a NaN fails: it compares false with everything */
        if (!(error <= ATOL + RTOL * fabs(expected[i]))) bad++;
        if (!(error <= worst) && !isnan(worst)) worst = error, worst_at = i;
    }
    if (bad) {
        fail("%s: %zu of %zu values of y differ from the reference (worst: %g at %zu, expected %g)",
             what, bad, count, worst, worst_at, expected[worst_at]);
        return 0;
    }
    print_timing(what, &reply->body.data, reply->round_trip_us);
    return 1;
}

static int run_scan(void *sock, int multipart) {
    enum { BATCH = 2, SEQ = 37, DIM = 12, STATE = 5 };
    size_t xn = (size_t)BATCH * SEQ * DIM, bn = (size_t)BATCH * SEQ * STATE;
    float *x = malloc(xn * 4), *dt = malloc(xn * 4), *z = malloc(xn * 4), *A = malloc(DIM * STATE * 4);
    float *B = malloc(bn * 4), *C = malloc(bn * 4), *D = malloc(DIM * 4);
    double *expected = malloc(xn * sizeof *expected);
    for (size_t i = 0; i < xn; i++) x[i] = uniform(-1, 1), dt[i] = uniform(-1, 1), z[i] = uniform(-2, 2);
    for (size_t i = 0; i < bn; i++) B[i] = uniform(-1, 1), C[i] = uniform(-1, 1);
    for (int i = 0; i < DIM * STATE; i++) A[i] = uniform(-2, -0.1f);
    for (int i = 0; i < DIM; i++) D[i] = uniform(-1, 1);
    reference_scan(BATCH, SEQ, DIM, STATE, x, dt, A, B, C, D, z, expected);

    msgpack_sbuffer body;
    msgpack_sbuffer_init(&body);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &body, msgpack_sbuffer_write);
    parts_t buffers = {.count = 0};
    parts_t *raw = multipart ? &buffers : NULL;
    const int xs[] = {BATCH, SEQ, DIM}, bs[] = {BATCH, SEQ, STATE}, as[] = {DIM, STATE}, ds[] = {DIM};
    const uint64_t id = multipart ? 4 : 2;
    pack_envelope(&pk, id, "scan", 8);
    pack_tensor(&pk, "x", x, xs, 3, raw);
    pack_tensor(&pk, "dt", dt, xs, 3, raw);
    pack_tensor(&pk, "A", A, as, 2, raw);
    pack_tensor(&pk, "B", B, bs, 3, raw);
    pack_tensor(&pk, "C", C, bs, 3, raw);
    pack_tensor(&pk, "D", D, ds, 1, raw);
    pack_tensor(&pk, "z", z, xs, 3, raw);
    pack_string(&pk, "dt_softplus");
    msgpack_pack_true(&pk);

    reply_t reply;
    int ok = 0;
    const char *what = multipart ? "scan multipart" : "scan inline";
    if (exchange(sock, what, id, &body, &buffers, &reply)) {
        if (multipart != (reply.parts.count > 1))
            fail("%s: the reply should %suse raw buffers", what, multipart ? "" : "not ");
        else
            ok = check_y(what, &reply, expected, xs, 3);
        close_reply(&reply);
    }
    msgpack_sbuffer_destroy(&body);
    free_parts(&buffers);
    /* Sent as raw buffers, the inputs are ZeroMQ's now (send_request); inline, the body had copies. */
    if (!multipart) free(x), free(dt), free(z), free(A), free(B), free(C), free(D);
    free(expected);
    return ok;
}

/* The reference of ssd_scan (SPEC §6, Mamba-2) in double, with D per head, z, dt_softplus and
 * a lower dt bound: per head, h = exp(dt·A)·h + dt·(x ⊗ B), y = h·C + D·x, then y·silu(z); group
 * g of B and C serves heads [g·heads/groups, (g + 1)·heads/groups). */
static void reference_ssd_scan(int b, int l, int heads, int p, int groups, int n, double dt_low, const float *x,
                               const float *dt, const float *A, const float *B, const float *C, const float *D,
                               const float *z, double *y) {
    double *h = calloc((size_t)heads * p * n, sizeof *h);
    for (int bi = 0; bi < b; bi++) {
        memset(h, 0, (size_t)heads * p * n * sizeof *h);
        for (int t = 0; t < l; t++) {
            size_t row = ((size_t)bi * l + t);
            for (int hd = 0; hd < heads; hd++) {
                const float *Bt = &B[(row * groups + hd / (heads / groups)) * n];
                const float *Ct = &C[(row * groups + hd / (heads / groups)) * n];
                double delta = dt[row * heads + hd];
                delta = delta > 20 ? delta : log1p(exp(delta));  /* softplus */
                delta = delta < dt_low ? dt_low : delta;
                double decay = exp(delta * A[hd]);
                for (int c = 0; c < p; c++) {
                    size_t at = (row * heads + hd) * p + c;
                    double xv = x[at], acc = 0;
                    for (int s = 0; s < n; s++) {
                        double *hs = &h[((size_t)hd * p + c) * n + s];
                        *hs = decay * *hs + delta * xv * Bt[s];
                        acc += Ct[s] * *hs;
                    }
                    acc += D[hd] * xv;
                    y[at] = acc * z[at] / (1 + exp(-z[at]));  /* y * silu(z) */
                }
            }
        }
    }
    free(h);
}

/* A Mamba-2 scan, tensors inline: x, z [batch, seq, heads, headdim], dt [batch, seq, heads],
 * A, D [heads], B, C [batch, seq, groups, state], and mamba_ssm's dt_limit (low, inf), sent as
 * a msgpack array of two floats. */
static int run_ssd_scan(void *sock) {
    enum { BATCH = 2, SEQ = 9, HEADS = 4, HEADDIM = 3, GROUPS = 2, STATE = 5 };
    const double dt_low = 0.05;
    size_t xn = (size_t)BATCH * SEQ * HEADS * HEADDIM, tn = (size_t)BATCH * SEQ * HEADS;
    size_t bn = (size_t)BATCH * SEQ * GROUPS * STATE;
    float *x = malloc(xn * 4), *z = malloc(xn * 4), *dt = malloc(tn * 4), *A = malloc(HEADS * 4);
    float *D = malloc(HEADS * 4), *B = malloc(bn * 4), *C = malloc(bn * 4);
    double *expected = malloc(xn * sizeof *expected);
    for (size_t i = 0; i < xn; i++) x[i] = uniform(-1, 1), z[i] = uniform(-2, 2);
    for (size_t i = 0; i < tn; i++) dt[i] = uniform(-4, 1);  /* softplus below dt_low now and then */
    for (size_t i = 0; i < bn; i++) B[i] = uniform(-1, 1), C[i] = uniform(-1, 1);
    for (int i = 0; i < HEADS; i++) A[i] = uniform(-2, -0.1f), D[i] = uniform(-1, 1);
    reference_ssd_scan(BATCH, SEQ, HEADS, HEADDIM, GROUPS, STATE, dt_low, x, dt, A, B, C, D, z, expected);

    msgpack_sbuffer body;
    msgpack_sbuffer_init(&body);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &body, msgpack_sbuffer_write);
    const int xs[] = {BATCH, SEQ, HEADS, HEADDIM}, ts[] = {BATCH, SEQ, HEADS}, hs[] = {HEADS},
              bs[] = {BATCH, SEQ, GROUPS, STATE};
    pack_envelope(&pk, 3, "ssd_scan", 9);
    pack_tensor(&pk, "x", x, xs, 4, NULL);
    pack_tensor(&pk, "dt", dt, ts, 3, NULL);
    pack_tensor(&pk, "A", A, hs, 1, NULL);
    pack_tensor(&pk, "B", B, bs, 4, NULL);
    pack_tensor(&pk, "C", C, bs, 4, NULL);
    pack_tensor(&pk, "D", D, hs, 1, NULL);
    pack_tensor(&pk, "z", z, xs, 4, NULL);
    pack_string(&pk, "dt_softplus");
    msgpack_pack_true(&pk);
    pack_string(&pk, "dt_limit");
    msgpack_pack_array(&pk, 2);
    msgpack_pack_double(&pk, dt_low);
    msgpack_pack_double(&pk, INFINITY);

    parts_t none = {.count = 0};
    reply_t reply;
    int ok = 0;
    if (exchange(sock, "ssd_scan", 3, &body, &none, &reply)) {
        ok = check_y("ssd_scan", &reply, expected, xs, 4);
        close_reply(&reply);
    }
    msgpack_sbuffer_destroy(&body);
    free(x), free(z), free(dt), free(A), free(D), free(B), free(C), free(expected);
    return ok;
}

static int run_ping(void *sock) {
    msgpack_sbuffer body;
    msgpack_sbuffer_init(&body);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &body, msgpack_sbuffer_write);
    pack_envelope(&pk, 1, "ping", 0);
    parts_t none = {.count = 0};
    reply_t reply;
    int ok = 0;
    if (exchange(sock, "ping", 1, &body, &none, &reply)) {
        const msgpack_object *pong = get(get(&reply.body.data, "result"), "pong");
        if (pong && pong->type == MSGPACK_OBJECT_BOOLEAN && pong->via.boolean) {
            ok = 1;
            print_timing("ping", &reply.body.data, reply.round_trip_us);
        } else {
            fail("ping: the reply is not {\"pong\": true}");
        }
        close_reply(&reply);
    }
    msgpack_sbuffer_destroy(&body);
    return ok;
}

int main(int argc, char **argv) {
    if (argc < 2 || argc > 3) {
        fprintf(stderr, "usage: scan_client ENDPOINT [VECTORS_DIR]\n");
        return 2;
    }
    const char *vectors = argc > 2 ? argv[2] : "protocol/vectors";
    char multipart_dir[4096];
    snprintf(multipart_dir, sizeof multipart_dir, "%s/multipart", vectors);
    int single = check_vectors_in(vectors), multi = check_vectors_in(multipart_dir);
    if (single <= 0 || multi <= 0) fail("no golden vectors in %s and %s", vectors, multipart_dir);
    else printf("golden vectors: %d checked\n", single + multi);

    rng_state = ((uint64_t)time(NULL) << 20) ^ (uint64_t)getpid() ^ 0x9E3779B97F4A7C15ull;
    void *context = zmq_ctx_new();
    void *sock = zmq_socket(context, ZMQ_DEALER);
    int linger = 0;  /* each receive sets its own timeout: what is left of its request's */
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof linger);
    /* An IPv6 literal (tcp://[::1]:PORT) connects only with this set; a host name is left
     * IPv4, which a server on 127.0.0.1 alone answers. */
    int ipv6 = strncmp(argv[1], "tcp://[", 7) == 0;
    zmq_setsockopt(sock, ZMQ_IPV6, &ipv6, sizeof ipv6);
    if (zmq_connect(sock, argv[1]) != 0) {
        fail("connect %s: %s", argv[1], zmq_strerror(zmq_errno()));
    } else if (run_ping(sock)) {
        run_scan(sock, 0);
        run_ssd_scan(sock);
        run_scan(sock, 1);  /* last: the only request with raw buffers (see send_request) */
    }
    zmq_close(sock);
    zmq_ctx_term(context);
    if (failures) fprintf(stderr, "%d failure(s)\n", failures);
    else printf("all checks passed\n");
    return failures ? 1 : 0;
}
