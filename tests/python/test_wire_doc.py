"""A client of the tensord wire protocol written from docs/PROTOCOL.md alone, run against tensord.

Nothing here imports the tensorshare package: frames, records and every reply body are encoded and
checked with raw sockets and struct, following the document section by section, the way someone
writing a client in another language would. The hex dumps of section 15 are read out of the
document itself, sent as they are (or with the version numbers of this run put in) and the
server's replies compared with them byte for byte. A check that the server fails while the
document is right is marked xfail(strict=True) with the reason.

Every socket read has a deadline (IO_TIMEOUT_S) and every loop a bound; the daemons come from
conftest.py (started on an ephemeral 127.0.0.1 port, stopped by PID).
"""
import array
import fcntl
import hashlib
import hmac
import mmap
import math
import os
import re
import socket
import struct
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
DOC_PATH = os.path.join(HERE, "..", "..", "docs", "PROTOCOL.md")

# seconds; the longest any single read waits for the server (a loaded 2-core machine)
IO_TIMEOUT_S = 10.0
# frames; the most frames read while looking for one reply or push
MAX_FRAMES_SCANNED = 1000

HEADER = struct.Struct("<BBBBHHIIQ")  # section 5: 24 bytes
assert HEADER.size == 24
MAGIC_REQ = 0x54
MAGIC_REP = 0x74

# section 8
OP = dict(HELLO=0x01, PING=0x02, PUT=0x03, APPEND=0x04, GET=0x05, PEEK=0x06, DELETE=0x07,
          LIST=0x08, LISTEN=0x09, UNLISTEN=0x0A, WAIT=0x0B, STATS=0x0C, SAVE=0x0D,
          STREAM_CREATE=0x16, STREAM_APPEND=0x17, STREAM_MARK=0x18, STREAM_CREDIT=0x19,
          STREAM_JOIN=0x1A, STREAM_READ=0x1B, STREAM_ACK=0x1C, STREAM_LEAVE=0x1D,
          STREAM_INFO=0x1E, STREAM_RANGE=0x1F, ADD=0x20, PUT_IF=0x21, TAKE=0x22, MGET=0x23,
          BARRIER=0x24, SVC_REGISTER=0x25, SVC_CALL=0x26, SVC_REPLY=0x27, TABLE_CREATE=0x28,
          TABLE_INSERT=0x29, TABLE_SAMPLE=0x2A, TABLE_UPDATE=0x2B, TABLE_REMOVE=0x2C,
          TABLE_INFO=0x2D, SHARD_MAP=0x30, AUTH_CHALLENGE=0x31, PS_CREATE=0x38, PS_PUSH=0x39,
          PS_PULL=0x3A, EMB_CREATE=0x3B, EMB_PULL=0x3C, EMB_PUSH=0x3D, NOTIFY=0x80,
          SVC_REQUEST=0x81)

# section 7
OK, NOT_FOUND, BAD_REQUEST, UNKNOWN_OPCODE, BAD_RECORD, TOO_LARGE = 0, 1, 2, 3, 4, 5
UNSUPPORTED_VERSION, AUTH_REQUIRED, AUTH_FAILED, WRONG_SHARD, TIMEOUT = 7, 8, 9, 11, 12
INVALID, BACKPRESSURE, VERSION_MISMATCH, STALE_GRADIENT, SERVICE_GONE = 17, 19, 20, 21, 22

# section 10.3: code -> (name, bytes per element, struct format or None)
DTYPES = {1: ("bool", 1, "?"), 2: ("uint8", 1, "B"), 3: ("int8", 1, "b"), 4: ("int16", 2, "h"),
          5: ("int32", 4, "i"), 6: ("int64", 8, "q"), 7: ("float16", 2, "e"),
          8: ("bfloat16", 2, None), 9: ("float32", 4, "f"), 10: ("float64", 8, "d"),
          11: ("complex64", 8, None), 12: ("complex128", 16, None)}
U64_MAX = 2**64 - 1


def align64(x):
    return (x + 63) // 64 * 64


def name(n):
    """Section 2: u8 length, then the bytes."""
    if isinstance(n, str):
        n = n.encode()
    assert len(n) <= 255
    return bytes([len(n)]) + n


# ---------------------------------------------------------------------------------------------
# Records (section 10)


class Tensor:
    def __init__(self, dtype, shape, data):
        self.dtype, self.shape, self.data = dtype, tuple(shape), bytes(data)

    def __eq__(self, other):
        return (isinstance(other, Tensor) and (self.dtype, self.shape, self.data) ==
                (other.dtype, other.shape, other.data))

    def __repr__(self):
        return "Tensor(%d, %r, %d bytes)" % (self.dtype, self.shape, len(self.data))


class Blob(bytes):
    """A byte string kept in the data area (value type 7)."""


def tensor_of(dtype, shape, values):
    fmt = DTYPES[dtype][2]
    return Tensor(dtype, shape, struct.pack("<%d%s" % (len(values), fmt), *values))


def encode_record(root):
    """The canonical encoding of section 10.4."""
    meta = bytearray()
    data = bytearray()

    def place(blob):
        off = align64(len(data))
        data.extend(bytes(off - len(data)))
        data.extend(blob)
        return off

    def value(v):
        if isinstance(v, dict):
            meta.extend(struct.pack("<BI", 1, len(v)))
            for k, item in v.items():
                kb = k.encode() if isinstance(k, str) else k
                meta.extend(struct.pack("<H", len(kb)) + kb)
                value(item)
        elif isinstance(v, list):
            meta.extend(struct.pack("<BI", 2, len(v)))
            for item in v:
                value(item)
        elif isinstance(v, Tensor):
            meta.extend(struct.pack("<BBBH", 3, v.dtype, len(v.shape), 0))
            for d in v.shape:
                meta.extend(struct.pack("<Q", d))
            meta.extend(struct.pack("<QQ", place(v.data), len(v.data)))
        elif isinstance(v, bool):
            raise TypeError("no bool value type")
        elif isinstance(v, int):
            meta.extend(struct.pack("<Bq", 4, v))
        elif isinstance(v, float):
            meta.extend(struct.pack("<Bd", 5, v))
        elif isinstance(v, Blob):
            meta.extend(struct.pack("<BQQ", 7, place(bytes(v)), len(v)))
        elif isinstance(v, str):
            b = v.encode()
            meta.extend(struct.pack("<BI", 6, len(b)) + b)
        else:
            raise TypeError(type(v))

    value(root)
    head = struct.pack("<4sIQ", b"TSR\x01", len(meta), len(data))
    pad = align64(16 + len(meta)) - 16 - len(meta)
    return head + bytes(meta) + bytes(pad) + bytes(data)


class RecordError(Exception):
    pass


def decode_record(rec):
    """Checks every rule of section 10.5 and returns the tree (strings as str, keys as str)."""
    rec = bytes(rec)

    def need(cond, what):
        if not cond:
            raise RecordError(what)

    need(len(rec) >= 16 and rec[:4] == b"TSR\x01", "rule 1")
    meta_len, data_len = struct.unpack_from("<IQ", rec, 4)
    need(meta_len <= len(rec) - 16, "rule 2")
    data_start = align64(16 + meta_len)
    need(data_start + data_len == len(rec), "rule 3")
    need(rec[16 + meta_len:data_start] == bytes(data_start - 16 - meta_len), "rule 4")
    end = 16 + meta_len
    pos = [16]
    prev_end = [0]

    def take(n):
        need(pos[0] + n <= end, "rule 8: field past meta")
        b = rec[pos[0]:pos[0] + n]
        pos[0] += n
        return b

    def data_range(off, length):
        need(off % 64 == 0, "rule 11: offset")
        need(off >= prev_end[0], "rule 11: order")
        need(off + length <= data_len, "rule 11: past data")
        prev_end[0] = off + length
        return rec[data_start + off:data_start + off + length]

    def value(level):
        need(level <= 32, "rule 7")
        (t,) = take(1)
        need(1 <= t <= 7, "rule 6")
        if t in (1, 2):
            (count,) = struct.unpack("<I", take(4))
            need(count * (3 if t == 1 else 1) <= end - pos[0], "rule 8: count")
            if t == 1:
                out = {}
                for _ in range(count):
                    (klen,) = struct.unpack("<H", take(2))
                    k = take(klen)
                    try:
                        k = k.decode()
                    except UnicodeDecodeError:
                        pass
                    out[k] = value(level + 1)
                return out
            return [value(level + 1) for _ in range(count)]
        if t == 3:
            dtype, ndim, res = struct.unpack("<BBH", take(4))
            need(dtype in DTYPES and ndim <= 8 and res == 0, "rule 9")
            dims = struct.unpack("<%dQ" % ndim, take(8 * ndim))
            size = DTYPES[dtype][1]
            for d in dims:
                need(d <= 2**63 - 1, "rule 9: dim")
                size *= d
                need(size <= U64_MAX, "rule 10: overflow")
            off, length = struct.unpack("<QQ", take(16))
            need(size == length, "rule 10: size")
            return Tensor(dtype, dims, data_range(off, length))
        if t == 4:
            return struct.unpack("<q", take(8))[0]
        if t == 5:
            return struct.unpack("<d", take(8))[0]
        if t == 6:
            (slen,) = struct.unpack("<I", take(4))
            return take(slen).decode()
        off, length = struct.unpack("<QQ", take(16))
        return Blob(data_range(off, length))

    root = value(1)
    need(pos[0] == end, "rule 5")
    return root


def int_record(v):
    return encode_record(v)


# ---------------------------------------------------------------------------------------------
# Reply bodies (sections 8, streams, tables, coordination)


def bin_state(body):
    assert len(body) == 16, "a bin state is exactly 16 bytes (section 5)"
    version, n, res = struct.unpack("<QII", body)
    assert res == 0
    return version, n


def items(body, check_records=True):
    """Section 8 "Items": (version, remaining, [record bytes]); checks layout and padding."""
    assert len(body) >= 16
    version, n, remaining = struct.unpack_from("<QII", body)
    head = align64(16 + 8 * n)
    lens = struct.unpack_from("<%dQ" % n, body, 16)
    assert body[16 + 8 * n:head] == bytes(head - 16 - 8 * n), "padding after the lengths"
    pos, recs = head, []
    for ln in lens:
        assert pos % 64 == 0
        recs.append(body[pos:pos + ln])
        padded = align64(ln)
        assert body[pos + ln:pos + padded] == bytes(padded - ln), "padding after a record"
        pos += padded
    assert pos == len(body), "body_len = align64(16 + 8n) + sum align64(item_len)"
    if check_records:
        for r in recs:
            decode_record(r)
    return version, remaining, recs


def entries(body):
    """Section 8 streams "Entries": (first_id, last_id, lost, [(head dict, record or None)])."""
    first, last, lost, n, res = struct.unpack_from("<QQQII", body)
    assert res == 0 and n <= 1024
    heads = []
    for i in range(n):
        eid, ln, tag, rows, dlv, kind, flags = struct.unpack_from("<QQQIHBB", body, 32 + 32 * i)
        assert kind in (0, 1) and flags & ~1 == 0
        assert (kind == 1 and ln == 0) or (kind == 0 and tag == 0)
        heads.append(dict(id=eid, len=ln, tag=tag, rows_done=rows, deliveries=dlv, kind=kind,
                          flags=flags))
    pos = align64(32 + 32 * n)
    assert body[32 + 32 * n:pos] == bytes(pos - 32 - 32 * n)
    out = []
    for h in heads:
        if h["kind"] == 1:
            out.append((h, None))
            continue
        rec = body[pos:pos + h["len"]]
        decode_record(rec)
        padded = align64(h["len"])
        assert body[pos + h["len"]:pos + padded] == bytes(padded - h["len"])
        pos += padded
        out.append((h, rec))
    assert pos == len(body)
    return first, last, lost, out


# ---------------------------------------------------------------------------------------------
# Frames and connections (sections 4 to 6)


class Frame:
    def __init__(self, raw):
        self.raw = raw
        (self.magic, self.version, self.opcode, self.flags, self.status, self.res1, self.rid,
         self.res2, self.body_len) = HEADER.unpack_from(raw)
        self.body = raw[24:]

    def __repr__(self):
        return "Frame(op=0x%02x status=%d rid=%d body=%r)" % (self.opcode, self.status,
                                                              self.rid, self.body[:80])


class Closed(Exception):
    pass


def frame(op, body=b"", rid=1, flags=0, magic=MAGIC_REQ, version=1, status=0, res1=0, res2=0,
          body_len=None):
    if body_len is None:
        body_len = len(body)
    return HEADER.pack(magic, version, op, flags, status, res1, rid, res2, body_len) + body


class Conn:
    """One connection; replies are matched by request id, pushes (request id 0) kept aside."""

    def __init__(self, port, hello=True, hello_flags=0, token=b""):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S)
        self.next_rid = 1
        self.buf = b""
        self.pending = []  # frames received while another one was looked for
        self.hello_body = None
        if hello:
            rep = self.call(OP["HELLO"], struct.pack("<BBH", 1, hello_flags, len(token)) + token)
            assert rep.status == OK, rep
            self.hello_body = rep.body

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def rid(self):
        r = self.next_rid
        self.next_rid += 1
        return r

    def send(self, op, body=b"", rid=None, **kw):
        if rid is None:
            rid = self.rid()
        self.sock.sendall(frame(op, body, rid=rid, **kw))
        return rid

    def _read(self, n, deadline):
        while len(self.buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("no frame in time")
            self.sock.settimeout(left)
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise Closed()
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def read_frame(self, timeout=IO_TIMEOUT_S):
        deadline = time.monotonic() + timeout
        head = self._read(24, deadline)
        magic, version, op, flags, status, r1, rid, r2, blen = HEADER.unpack(head)
        # Section 5: a client closes on a malformed header; here that is a failed test.
        assert magic == MAGIC_REP and version == 1 and flags == 0 and r1 == 0 and r2 == 0, head
        return Frame(head + self._read(blen, deadline))

    def wait_for(self, match, timeout=IO_TIMEOUT_S):
        for i, f in enumerate(self.pending):
            if match(f):
                return self.pending.pop(i)
        deadline = time.monotonic() + timeout
        for _ in range(MAX_FRAMES_SCANNED):
            f = self.read_frame(max(0.0, deadline - time.monotonic()))
            if match(f):
                return f
            self.pending.append(f)
        raise AssertionError("too many unrelated frames")

    def reply(self, rid, timeout=IO_TIMEOUT_S):
        return self.wait_for(lambda f: f.rid == rid and f.opcode < 0x80, timeout)

    def push(self, op, timeout=IO_TIMEOUT_S):
        return self.wait_for(lambda f: f.rid == 0 and f.opcode == op, timeout)

    def call(self, op, body=b"", timeout=IO_TIMEOUT_S, **kw):
        rid = self.send(op, body, **kw)
        rep = self.reply(rid, timeout)
        assert rep.opcode == op, rep
        return rep

    def ok(self, op, body=b"", **kw):
        rep = self.call(op, body, **kw)
        assert rep.status == OK, rep
        return rep.body

    def waiting(self, rid):
        """True when the request is still unanswered after the server handled it: a PING sent
        after it is answered (requests of a connection are handled in order, section 6)."""
        self.ok(OP["PING"])
        return self.nothing_arrives(0.05) and not any(f.rid == rid for f in self.pending)

    def nothing_arrives(self, seconds):
        """True when no frame arrives within the time."""
        try:
            f = self.read_frame(seconds)
        except socket.timeout:
            return True
        self.pending.append(f)
        return False

    def closed_by_server(self, timeout=IO_TIMEOUT_S):
        """True when the server ends the stream in time with nothing more on it (section 13:
        after an error that closes, it reads no more frames, so a PING sent now is not
        answered), and the frames read so far held nothing unexpected."""
        assert not self.buf and not self.pending, (self.buf, self.pending)
        deadline = time.monotonic() + timeout
        try:
            self.sock.sendall(frame(OP["PING"], rid=4242))
        except OSError:
            pass  # the server may have closed already
        self.sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = self.sock.recv(65536)
        except socket.timeout:
            return False
        except ConnectionResetError:
            return True
        assert chunk == b"", ("bytes after the error that closes", chunk)
        return True


def error_reply(rep, status, op=None, rid=None):
    """Section 5: an error reply has the request's opcode and id, the status and a message."""
    assert rep.status == status, rep
    if op is not None:
        assert rep.opcode == op, rep
    if rid is not None:
        assert rep.rid == rid, rep
    assert len(rep.body) <= 1024
    rep.body.decode("utf-8")


# ---------------------------------------------------------------------------------------------
# The hex dumps of section 15 (and of section 4)


def doc_text():
    with open(DOC_PATH, encoding="utf-8") as f:
        return f.read()


def doc_examples():
    out = {}
    pattern = r"<!-- (?:rows |ref )?example: ([\w-]+) -->\n```text\n(.*?)```"
    for m in re.finditer(pattern, doc_text(), re.S):
        label, data = m.group(1), bytearray()
        for line in m.group(2).splitlines():
            # up to 16 bytes, then the meaning after two spaces (one after a full row)
            mm = (re.match(r"^([0-9a-f]{4})  ([0-9a-f]{2}(?: [0-9a-f]{2}){15})(?: |$)", line) or
                  re.match(r"^([0-9a-f]{4})  ([0-9a-f]{2}(?: [0-9a-f]{2}){0,14})(?:  |$)", line))
            assert mm, (label, line)
            assert int(mm.group(1), 16) == len(data), ("offset column", label, line)
            data += bytes.fromhex(mm.group(2))
        assert label not in out, label
        out[label] = bytes(data)
    return out


EX = doc_examples()


def with_u64(data, offset, value):
    return data[:offset] + struct.pack("<Q", value) + data[offset + 8:]


def u64_at(data, offset):
    return struct.unpack_from("<Q", data, offset)[0]


def shifted(doc, offsets, delta):
    """The doc's frame with the versions at the given offsets moved by delta (this run's clock)."""
    for off in offsets:
        doc = with_u64(doc, off, u64_at(doc, off) + delta)
    return doc


def test_doc_examples_are_well_formed():
    assert len(EX) >= 60
    for label, data in EX.items():
        f = Frame(data)
        assert f.body_len == len(data) - 24, label
        assert f.magic == (MAGIC_REQ if label.endswith("-req") else MAGIC_REP), label
        assert f.version == 1 and f.res1 == 0 and f.res2 == 0, label
        if label.endswith("-req"):
            assert f.status == 0, label
        if f.flags == 0 and label.endswith("-req") and f.opcode in (OP["PUT"], OP["APPEND"]):
            # the record of an upload example passes section 10.5
            decode_record(f.body[1 + f.body[0]:])


def test_doc_token_proof_vectors():
    """Section 4: the proofs in the dumps are the HMACs the text defines."""
    token = b"s3cret-token"
    cn, sn = bytes(range(32)), bytes(range(0x80, 0xA0))
    assert EX["auth-challenge-req"][24:] == cn and EX["auth-challenge-rep"][24:] == sn
    label_c = b"tensorshare token proof v1 client"
    label_s = b"tensorshare token proof v1 server"
    assert len(label_c) == 33
    proof_c = hmac.new(token, label_c + b"\0" + cn + sn, hashlib.sha256).digest()
    proof_s = hmac.new(token, label_s + b"\0" + cn + sn, hashlib.sha256).digest()
    assert EX["hello-proof-req"][28:] == proof_c
    assert EX["hello-proof-rep"][48:] == proof_s


# ---------------------------------------------------------------------------------------------
# Section 15's session, replayed against a real tensord


def test_session_replay(start_tensord, tmp_path):
    d = start_tensord("--save", str(tmp_path / "snap.tsd"))
    other = Conn(d.port)
    # Before the session the server holds `log` with two items, the ints 40 and 41.
    for v in (40, 41):
        other.ok(OP["APPEND"], name("log") + int_record(v))

    s = socket.create_connection(("127.0.0.1", d.port), timeout=IO_TIMEOUT_S)
    c = Conn.__new__(Conn)
    c.sock, c.buf, c.pending, c.next_rid = s, b"", [], 100

    def exchange(req, rid):
        s.sendall(req)
        return c.reply(rid).raw

    # 1 HELLO: the server grants LZ4 and announces 1 GiB (tensord's default --max-frame)
    rep = exchange(EX["hello-req"], 1)
    assert rep[:0x28] == EX["hello-rep"][:0x28]
    assert len(rep) == len(EX["hello-rep"])
    assert exchange(EX["ping-req"], 2) == EX["ping-rep"]

    rep = exchange(EX["put-req"], 3)
    delta = u64_at(rep, 0x18) - u64_at(EX["put-rep"], 0x18)
    assert rep == shifted(EX["put-rep"], [0x18], delta)
    assert exchange(EX["append-req"], 4) == shifted(EX["append-rep"], [0x18], delta)
    assert exchange(EX["get-req"], 5) == shifted(EX["get-rep"], [0x18], delta)
    assert exchange(EX["peek-req"], 6) == shifted(EX["peek-rep"], [0x18], delta)
    assert exchange(EX["delete-req"], 7) == EX["delete-rep"]
    assert exchange(EX["list-req"], 8) == shifted(EX["list-rep"], [0x30], delta)
    assert exchange(EX["listen-req"], 9) == EX["listen-rep"]

    # another client PUTs into `params`: version ...045 and a NOTIFY to the listener
    ver, n = bin_state(other.ok(OP["PUT"], name("params") + int_record(7)))
    assert ver == u64_at(EX["notify"], 0x18) + delta and n == 1
    assert c.push(OP["NOTIFY"]).raw == shifted(EX["notify"], [0x18], delta)

    assert exchange(EX["unlisten-req"], 10) == EX["unlisten-rep"]
    wait = with_u64(EX["wait-req"], 0x1F, u64_at(EX["wait-req"], 0x1F) + delta)
    assert exchange(wait, 11) == shifted(EX["wait-rep"], [0x18], delta)

    rep = Frame(exchange(EX["stats-req"], 12))
    assert rep.raw[:0x10] == EX["stats-rep"][:0x10]
    stats = decode_record(rep.body)
    assert all(isinstance(v, int) for v in stats.values())
    assert stats["bins"] == 2 and "uptime_s" in stats
    assert exchange(EX["save-req"], 13) == EX["save-rep"]

    # 14: a GET of a bin that does not exist
    s.sendall(frame(OP["GET"], name("nothing") + struct.pack("<I", 0), rid=14))
    rep = c.reply(14)
    error_reply(Frame(rep.raw), NOT_FOUND, OP["GET"], 14)
    assert rep.raw[:0x10] == EX["error-rep"][:0x10]

    # 15: the compressed PUT; the server inflates it to a float32[64] of zeros
    rep = exchange(EX["put-lz4-req"], 15)
    assert bin_state(Frame(rep).body) == (u64_at(EX["put-rep"], 0x18) + delta + 4, 1)
    c.next_rid = 16
    _, _, recs = items(c.ok(OP["PEEK"], name("zeros") + struct.pack("<I", 0)))
    assert len(recs) == 1 and len(recs[0]) == 320
    assert decode_record(recs[0]) == Tensor(9, (64,), bytes(256))

    # Tensor bins and rows: TENSOR_BIN `emb`, LISTEN to it (not shown), WRITE_ROWS, READ_ROWS
    assert exchange(EX["tensor-bin-req"], 16) == shifted(EX["tensor-bin-rep"], [0x18], delta)
    c.next_rid = 99
    c.ok(OP["LISTEN"], name("emb"))
    assert exchange(EX["write-rows-req"], 17) == shifted(EX["write-rows-rep"], [0x18], delta)
    assert c.push(OP["NOTIFY"]).raw == shifted(EX["notify-rows"], [0x18], delta)
    assert exchange(EX["read-rows-req"], 18) == shifted(EX["read-rows-rep"], [0x18], delta)
    c.close()
    other.close()


def test_error_reply_message_matches_dump(tensord):
    """Section 15 "An error reply": the header is the dump's; tensord's message names the bin."""
    with Conn(tensord.port) as c:
        c.next_rid = 14
        rep = c.call(OP["GET"], name("params") + struct.pack("<I", 0))
        error_reply(rep, NOT_FOUND, OP["GET"], 14)
        doc = Frame(EX["error-rep"])
        assert rep.raw[:0x10] == doc.raw[:0x10] and doc.body == b"no such bin"
        assert rep.body == b"no such bin: params"


def test_wait_timeout_dump(tensord):
    with Conn(tensord.port) as c:
        c.next_rid = 11
        req = with_u64(EX["wait-req"], 0x1F, 0)[:0x27] + struct.pack("<I", 0)
        c.sock.sendall(req)
        assert c.reply(11).raw == EX["wait-rep-timeout"]


# ---------------------------------------------------------------------------------------------
# Records of every kind through PUT, APPEND, GET, PEEK, LIST, DELETE


def sample_records():
    f16 = struct.pack("<3e", 1.5, -2.0, 0.25)
    return [
        0,
        -(2**63),
        2**63 - 1,
        -0.0,
        float("inf"),
        struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000ABC))[0],  # a NaN with a payload
        "",
        "h\u00e9llo\x00w\u00f6rld",
        Blob(b"\x00\xffraw bytes"),
        {},
        [],
        {"nested": {"list": [1, 2.5, "three", [Blob(b""), {"deep": [[[[7]]]]}]]}},
        {b"\xff\x00key": 1, "": 2},
        {
            "bool": tensor_of(1, (4,), [True, False, True, True]),
            "u8": tensor_of(2, (2, 3), list(range(6))),
            "i8": tensor_of(3, (3,), [-1, 0, 127]),
            "i16": tensor_of(4, (1, 2), [-300, 300]),
            "i32": tensor_of(5, (2, 2), [1, -2, 3, -4]),
            "i64": tensor_of(6, (2,), [2**62, -(2**62)]),
            "f16": Tensor(7, (3,), f16),
            "bf16": Tensor(8, (2,), b"\x80\x3f\x00\x40"),
            "f32": tensor_of(9, (2, 1, 2), [1.0, 2.0, 3.0, 4.0]),
            "f64": tensor_of(10, (), [math.pi]),  # a scalar: ndim 0, one element
            "c64": Tensor(11, (1,), struct.pack("<2f", 1.0, -1.0)),
            "c128": Tensor(12, (1,), struct.pack("<2d", 0.5, -0.5)),
            "empty": Tensor(9, (0, 5), b""),
            "eight": Tensor(2, (1,) * 8, b"\x07"),
            "after_empty": tensor_of(6, (1,), [9]),
        },
        [Tensor(9, (16,), bytes(64)), Tensor(9, (0,), b"")],  # the data area ends with an empty
    ]


def test_records_round_trip(tensord):
    recs = [encode_record(v) for v in sample_records()]
    for r, v in zip(recs, sample_records()):
        back = decode_record(r)
        if isinstance(v, float) and math.isnan(v):
            assert struct.pack("<d", back) == struct.pack("<d", v)
        else:
            assert back == v
    with Conn(tensord.port) as c:
        ver, n = bin_state(c.ok(OP["PUT"], name("r") + recs[0]))
        assert n == 1
        last = ver
        for i, r in enumerate(recs[1:]):
            v2, n = bin_state(c.ok(OP["APPEND"], name("r") + r))
            assert v2 > last and n == i + 2
            last = v2
        # PEEK all: the same bytes, oldest first, the bin's version, all remain
        ver, remaining, got = items(c.ok(OP["PEEK"], name("r") + struct.pack("<I", 0)))
        assert (ver, remaining) == (last, len(recs)) and got == recs
        # LIST: one entry with the count, the total bytes and the version
        body = c.ok(OP["LIST"])
        n, res = struct.unpack_from("<II", body)
        assert (n, res) == (1, 0)
        ln = body[8]
        assert body[9:9 + ln] == b"r"
        assert struct.unpack_from("<IQQ", body, 9 + ln) == (len(recs), sum(map(len, recs)), last)
        assert len(body) == 9 + ln + 20
        # GET 3: the oldest three, a new version, the rest remain
        ver, remaining, got = items(c.ok(OP["GET"], name("r") + struct.pack("<I", 3)))
        assert got == recs[:3] and remaining == len(recs) - 3 and ver > last
        # PEEK 1 changes nothing
        ver2, remaining, got = items(c.ok(OP["PEEK"], name("r") + struct.pack("<I", 1)))
        assert ver2 == ver and remaining == len(recs) - 3 and got == recs[3:4]
        # DELETE removes the rest; a second DELETE is version 0, 0 items
        ver3, n = bin_state(c.ok(OP["DELETE"], name("r")))
        assert ver3 > ver and n == len(recs) - 3
        assert bin_state(c.ok(OP["DELETE"], name("r"))) == (0, 0)
        error_reply(c.call(OP["PEEK"], name("r") + struct.pack("<I", 0)), NOT_FOUND)
        assert c.ok(OP["LIST"]) == bytes(8)
        # the empty name is a valid name
        bin_state(c.ok(OP["PUT"], name("") + recs[0]))
        assert items(c.ok(OP["GET"], name("") + struct.pack("<I", 0)))[2] == [recs[0]]


def test_list_sorted_by_name_bytes(tensord):
    with Conn(tensord.port) as c:
        for n in ("b", "ab", "a", "abc", "B"):
            c.ok(OP["PUT"], name(n) + int_record(1))
        body = c.ok(OP["LIST"])
        pos, names = 8, []
        for _ in range(struct.unpack_from("<I", body)[0]):
            ln = body[pos]
            names.append(body[pos + 1:pos + 1 + ln])
            pos += 1 + ln + 20
        assert pos == len(body)
        assert names == [b"B", b"a", b"ab", b"abc", b"b"]


# ---------------------------------------------------------------------------------------------
# Error replies and what closes a connection (sections 5, 7, 13)

BAD_HEADERS = [
    # (what, frame bytes, status); each one is answered with the request's opcode and id, then
    # the server closes the connection
    ("unknown opcode", frame(0x7F, b"", rid=9), UNKNOWN_OPCODE),
    ("NOTIFY as a request", frame(0x80, b"", rid=9), UNKNOWN_OPCODE),
    ("wrong magic", frame(OP["PING"], rid=9, magic=0x74), BAD_REQUEST),
    ("wrong version", frame(OP["PING"], rid=9, version=2), UNSUPPORTED_VERSION),
    ("version before reserved", frame(OP["PING"], rid=9, version=2, res2=1), UNSUPPORTED_VERSION),
    ("unknown flag", frame(OP["PING"], rid=9, flags=0x02), BAD_REQUEST),
    ("reserved u16", frame(OP["PING"], rid=9, res1=1), BAD_REQUEST),
    ("reserved u32", frame(OP["PING"], rid=9, res2=1), BAD_REQUEST),
    ("status in a request", frame(OP["PING"], rid=9, status=1), BAD_REQUEST),
    ("LZ4 not granted", frame(OP["PING"], b"\0" * 9, rid=9, flags=1), BAD_REQUEST),
    ("control body over 4096", frame(OP["DELETE"], b"", rid=9, body_len=4097), TOO_LARGE),
    ("unknown opcode over max_body", frame(0x7F, b"", rid=9, body_len=2**31), TOO_LARGE),
    ("upload over max_body", frame(OP["PUT"], b"", rid=9, body_len=2**30 + 1), TOO_LARGE),
    # the order of section 5's rules: the first one broken decides
    ("magic before version", frame(OP["PING"], rid=9, magic=0x55, version=2), BAD_REQUEST),
    ("LZ4 flag before max_body", frame(OP["PUT"], b"", rid=9, flags=1, body_len=2**31),
     BAD_REQUEST),
    ("unknown opcode before the control limit", frame(0x7F, b"", rid=9, body_len=5000),
     UNKNOWN_OPCODE),
    ("body too short", frame(OP["GET"], name("x"), rid=9), BAD_REQUEST),
    ("READ_ROWS key over 1024",
     frame(0x13, name("x") + struct.pack("<iH", 0, 1025) + b"k" * 1025 + bytes(16), rid=9),
     BAD_REQUEST),
    ("bytes left over", frame(OP["DELETE"], name("x") + b"\0", rid=9), BAD_REQUEST),
    ("name past the body", frame(OP["DELETE"], b"\x05ab", rid=9), BAD_REQUEST),
    ("empty upload", frame(OP["PUT"], b"", rid=9), BAD_REQUEST),
    ("bad record magic", frame(OP["PUT"], name("x") + b"TSX\x01" + bytes(60), rid=9), BAD_RECORD),
    ("record under 16 bytes", frame(OP["APPEND"], name("x") + b"TSR\x01", rid=9), BAD_RECORD),
    ("record with data_len past its end",
     frame(OP["PUT"], name("x") + int_record(1)[:8] + struct.pack("<Q", 64) + int_record(1)[16:],
           rid=9), BAD_RECORD),
    ("second HELLO", frame(OP["HELLO"], struct.pack("<BBH", 1, 0, 0), rid=9), BAD_REQUEST),
    ("AUTH_CHALLENGE after HELLO", frame(OP["AUTH_CHALLENGE"], bytes(32), rid=9), BAD_REQUEST),
    ("TAKE with a short body", frame(OP["TAKE"], name("x") + bytes(4), rid=9), BAD_REQUEST),
    ("TABLE_UPDATE n over 200",
     frame(OP["TABLE_UPDATE"], name("t") + struct.pack("<II", 201, 0) + bytes(16 * 201), rid=9),
     BAD_REQUEST),
    ("STREAM_JOIN empty group",
     frame(OP["STREAM_JOIN"], name("s") + name("") + name("m") + bytes(8), rid=9), BAD_REQUEST),
    ("GET_REF without FDS", frame(0x0E, name("x") + bytes(4), rid=9), BAD_REQUEST),
    ("PUT_FD without FDS", frame(0x10, name("x") + struct.pack("<Q", 64), rid=9), BAD_REQUEST),
    ("SVC_REPLY empty message",
     frame(OP["SVC_REPLY"], name("svc") + struct.pack("<QHHI", 1, INVALID, 0, 0), rid=9),
     BAD_REQUEST),
]


@pytest.mark.parametrize("what,data,status", BAD_HEADERS, ids=[b[0] for b in BAD_HEADERS])
def test_errors_that_close(tensord, what, data, status):
    with Conn(tensord.port) as c:
        c.ok(OP["PING"])
        c.sock.sendall(data)
        rep = c.read_frame()
        error_reply(rep, status, data[2], 9)
        assert c.closed_by_server(), "section 13: the server closes after this error"


BEFORE_HELLO = [
    ("PING before HELLO", frame(OP["PING"], rid=3), BAD_REQUEST, OP["PING"]),
    ("body over 4096 before HELLO", frame(OP["HELLO"], b"", rid=3, body_len=4097), TOO_LARGE,
     OP["HELLO"]),
    ("HELLO flag LZ4 and 5000 bytes",
     frame(OP["HELLO"], b"", rid=3, flags=1, body_len=5000), TOO_LARGE, OP["HELLO"]),
    ("PING of 5000 bytes before HELLO", frame(OP["PING"], b"", rid=3, body_len=5000), TOO_LARGE,
     OP["PING"]),
    ("status before the size before HELLO", frame(OP["HELLO"], b"", rid=3, status=1,
                                                  body_len=5000), BAD_REQUEST, OP["HELLO"]),
    ("max_version 0", frame(OP["HELLO"], struct.pack("<BBH", 0, 0, 0), rid=3),
     UNSUPPORTED_VERSION, OP["HELLO"]),
    ("AUTH_CHALLENGE of 31 bytes", frame(OP["AUTH_CHALLENGE"], bytes(31), rid=3), BAD_REQUEST,
     OP["AUTH_CHALLENGE"]),
    ("HELLO token_len past the body", frame(OP["HELLO"], struct.pack("<BBH", 1, 0, 5), rid=3),
     BAD_REQUEST, OP["HELLO"]),
]


@pytest.mark.parametrize("what,data,status,op", BEFORE_HELLO, ids=[b[0] for b in BEFORE_HELLO])
def test_errors_before_hello(tensord, what, data, status, op):
    with Conn(tensord.port, hello=False) as c:
        c.sock.sendall(data)
        rep = c.read_frame()
        error_reply(rep, status, op, 3)
        assert c.closed_by_server()


def test_errors_that_keep_the_connection(tensord):
    with Conn(tensord.port) as c:
        error_reply(c.call(OP["GET"], name("none") + struct.pack("<I", 0)), NOT_FOUND)
        error_reply(c.call(OP["UNLISTEN"], name("none")), NOT_FOUND)
        error_reply(c.call(OP["SAVE"]), INVALID)  # no --save
        c.ok(OP["PING"])


def test_hello_reply_fields(tensord):
    with Conn(tensord.port, hello=False) as c:
        rep = c.call(OP["HELLO"], struct.pack("<BBH", 9, 0xF8, 3) + b"abc")
        # a higher max_version gets version 1; unknown flag bits are ignored and not granted;
        # a server without a token accepts any token
        ver, flags, r16, r32, max_body, server_id = struct.unpack("<BBHIQQ", rep.body)
        assert (rep.status, ver, flags, r16, r32, max_body) == (OK, 1, 0, 0, 0, 2**30)
        with Conn(tensord.port) as c2:
            assert struct.unpack_from("<Q", c2.hello_body, 16)[0] == server_id
            stats = decode_record(c2.ok(OP["STATS"]))
            assert stats["server_id"] == server_id & (2**63 - 1)
        # FDS is not granted on TCP
        with Conn(tensord.port, hello_flags=0x02) as c3:
            assert c3.hello_body[1] == 0


def test_token_proof_without_token(tensord):
    """Section 4: every server answers AUTH_CHALLENGE; without a token TOKEN_PROOF is ignored."""
    with Conn(tensord.port, hello=False) as c:
        sn = c.ok(OP["AUTH_CHALLENGE"], os.urandom(32))
        assert len(sn) == 32
        body = c.ok(OP["HELLO"], struct.pack("<BBH", 1, 0x04, 32) + bytes(32))
        assert len(body) == 24 and body[1] == 0
    with Conn(tensord.port, hello=False) as c:
        # a TOKEN_PROOF without AUTH_CHALLENGE is accepted too
        body = c.ok(OP["HELLO"], struct.pack("<BBH", 1, 0x04, 32) + bytes(32))
        assert len(body) == 24 and body[1] == 0


def test_token_proof_with_token(start_tensord, tmp_path):
    token = b"s3cret-token"
    path = tmp_path / "token"
    path.write_bytes(token)
    d = start_tensord("--auth-token-file", str(path))
    with Conn(d.port, hello=False) as c:
        cn = os.urandom(32)
        sn = c.ok(OP["AUTH_CHALLENGE"], cn)
        lc, ls = b"tensorshare token proof v1 client\0", b"tensorshare token proof v1 server\0"
        proof = hmac.new(token, lc + cn + sn, hashlib.sha256).digest()
        body = c.ok(OP["HELLO"], struct.pack("<BBH", 1, 0x04, 32) + proof)
        assert len(body) == 56 and body[1] == 0x04
        assert body[24:] == hmac.new(token, ls + cn + sn, hashlib.sha256).digest()
        c.ok(OP["PING"])
    cases = [
        (b"", None, AUTH_REQUIRED),  # empty token
        (token, None, AUTH_FAILED),  # a token in clear
        (bytes(32), "proof", AUTH_FAILED),  # a wrong proof
        (bytes(32), None, AUTH_FAILED),  # a proof without AUTH_CHALLENGE (flag set below)
    ]
    for tok, challenge, status in cases:
        with Conn(d.port, hello=False) as c:
            flags = 0x04 if len(tok) == 32 else 0
            if challenge:
                c.ok(OP["AUTH_CHALLENGE"], os.urandom(32))
            rep = c.call(OP["HELLO"], struct.pack("<BBH", 1, flags, len(tok)) + tok)
            error_reply(rep, status, OP["HELLO"])
            assert c.closed_by_server()


def test_shard_map_not_sharded(tensord):
    with Conn(tensord.port) as c:
        assert c.ok(OP["SHARD_MAP"]) == struct.pack("<QHHI", 0, 0, 0xFFFF, 0)


def test_shard_dumps(start_tensord, tmp_path):
    path = tmp_path / "map"
    path.write_text("epoch 3\n10.0.0.1:8000\n10.0.0.2:8000\n")
    d = start_tensord("--cluster-map", str(path), "--shard", "1")
    with Conn(d.port) as c:
        c.sock.sendall(EX["shard-map-req"])
        assert c.reply(2).raw == EX["shard-map-rep"]
        c.next_rid = 3
        rep = c.call(OP["GET"], name("params") + struct.pack("<I", 0))
        assert rep.raw == EX["wrong-shard-rep"]


# ---------------------------------------------------------------------------------------------
# LISTEN, NOTIFY, WAIT (sections 8.9 to 8.11, 8.14, 9)


def test_listen_and_wait(tensord):
    with Conn(tensord.port) as a, Conn(tensord.port) as b:
        assert bin_state(a.ok(OP["LISTEN"], name("q"))) == (0, 0)
        # the connection that makes a change gets its reply before the change's NOTIFY
        a.send(OP["APPEND"], name("own") + int_record(0), rid=77)
        a.send(OP["LISTEN"], name("own"), rid=79)
        a.send(OP["APPEND"], name("own") + int_record(0), rid=78)
        got = [(f.rid, f.opcode) for f in (a.read_frame() for _ in range(4))]
        assert got == [(77, OP["APPEND"]), (79, OP["LISTEN"]), (78, OP["APPEND"]),
                       (0, OP["NOTIFY"])]
        rid = a.send(OP["WAIT"], name("q") + struct.pack("<QI", 0, 5000))
        assert a.waiting(rid)  # the WAIT is pending
        v1, _ = bin_state(b.ok(OP["PUT"], name("q") + int_record(1)))
        w = a.reply(rid)
        assert w.status == OK and bin_state(w.body) == (v1, 1)
        v2, n = bin_state(b.ok(OP["APPEND"], name("q") + int_record(2)))
        v3 = items(b.ok(OP["GET"], name("q") + struct.pack("<I", 1)))[0]
        v4, n4 = bin_state(b.ok(OP["DELETE"], name("q")))
        assert v1 < v2 < v3 < v4 and n4 == 1
        seen = []
        for _ in range(4):
            f = a.push(OP["NOTIFY"])
            ver, n, event, flags = struct.unpack_from("<QIBB", f.body)
            assert f.body[14:] == name("q")
            seen.append((ver, n, event, flags))
        assert seen == [(v1, 1, 1, 0), (v2, 2, 2, 0), (v3, 1, 3, 0), (v4, 0, 4, 0)]
        # WAIT answered at once, and WAIT on a missing bin with timeout 0
        assert a.ok(OP["UNLISTEN"], name("q")) == b""
        rep = a.call(OP["WAIT"], name("q") + struct.pack("<QI", 0, 0))
        assert rep.status == TIMEOUT and bin_state(rep.body) == (0, 0)
        b.ok(OP["PUT"], name("q") + int_record(3))
        assert a.nothing_arrives(0.2), "no NOTIFY after UNLISTEN"


# ---------------------------------------------------------------------------------------------
# Coordination (sections 8.39 to 8.43)


def test_coordination_dumps(tensord):
    with Conn(tensord.port) as c:
        c.sock.sendall(EX["add-req"])
        rep = c.reply(2).raw
        delta = u64_at(rep, 0x20) - u64_at(EX["add-rep"], 0x20)
        assert rep == shifted(EX["add-rep"], [0x20], delta)
        c.next_rid = 3
        rep = c.call(OP["PUT_IF"], name("step") + struct.pack("<Q", 0) + int_record(5))
        assert rep.raw == shifted(EX["put-if-rep-mismatch"], [0x18], delta)
        # the counter's record is the canonical 64-byte record of the int
        _, _, recs = items(c.ok(OP["PEEK"], name("step") + struct.pack("<I", 0)))
        assert recs == [int_record(1)]


def test_coordination(tensord):
    with Conn(tensord.port) as a, Conn(tensord.port) as b:
        val, ver = struct.unpack("<qQ", a.ok(OP["ADD"], name("n") + struct.pack("<q", -5)))
        assert val == -5
        val, ver2 = struct.unpack("<qQ", a.ok(OP["ADD"], name("n") + struct.pack("<q", 7)))
        assert val == 2 and ver2 > ver
        rep = a.call(OP["ADD"], name("n") + struct.pack("<q", 2**63 - 1))
        error_reply(rep, INVALID)
        a.ok(OP["PUT"], name("notctr") + encode_record("x"))
        error_reply(a.call(OP["ADD"], name("notctr") + struct.pack("<q", 1)), INVALID)
        # PUT_IF: a matching version wins, a stale one loses with the current state
        v3, n = bin_state(a.ok(OP["PUT_IF"], name("n") + struct.pack("<Q", ver2) + int_record(9)))
        assert v3 > ver2 and n == 1
        rep = a.call(OP["PUT_IF"], name("n") + struct.pack("<Q", ver2) + int_record(10))
        assert rep.status == VERSION_MISMATCH and bin_state(rep.body) == (v3, 1)
        v4, _ = bin_state(a.ok(OP["PUT_IF"], name("fresh") + struct.pack("<Q", 0) +
                               int_record(1)))
        assert v4 > v3
        # TAKE waits and is served by an APPEND of another connection
        rid = a.send(OP["TAKE"], name("jobs") + struct.pack("<II", 1, 5000))
        assert a.waiting(rid)
        b.ok(OP["APPEND"], name("jobs") + int_record(11))
        b.ok(OP["APPEND"], name("jobs") + int_record(12))
        rep = a.reply(rid)
        assert rep.status == OK
        _, remaining, recs = items(rep.body)
        # the first APPEND answers the TAKE, before the second one arrives
        assert recs == [int_record(11)] and remaining == 0
        error_reply(a.call(OP["TAKE"], name("none") + struct.pack("<II", 0, 0)), TIMEOUT)
        # MGET: found and missing, each block an items body
        body = a.ok(OP["MGET"], struct.pack("<II", 3, 0) + name("jobs") + name("none") +
                    name("n"))
        n, res = struct.unpack_from("<II", body)
        assert (n, res) == (3, 0)
        pos = align64(8 + 16 * n)
        found = []
        for i in range(n):
            f, r1, r2, r3, blen = struct.unpack_from("<BBHIQ", body, 8 + 16 * i)
            assert (r1, r2, r3) == (0, 0, 0) and blen % 64 == 0
            found.append(f)
            if f:
                _, _, recs = items(body[pos:pos + blen])
                assert recs == ([int_record(12)] if i == 0 else [int_record(9)])
            else:
                assert blen == 0
            pos += blen
        assert pos == len(body) and found == [1, 0, 1]
        # BARRIER of two parties on two connections; a third party count is INVALID meanwhile
        rid = a.send(OP["BARRIER"], name("bar") + struct.pack("<II", 2, 5000))
        assert a.waiting(rid)
        error_reply(b.call(OP["BARRIER"], name("bar") + struct.pack("<II", 3, 5000)), INVALID)
        rb = b.ok(OP["BARRIER"], name("bar") + struct.pack("<II", 2, 5000))
        ra = a.reply(rid)
        assert ra.status == OK and ra.body == rb == struct.pack("<QII", 1, 2, 0)


# ---------------------------------------------------------------------------------------------
# Streams (sections 8.23 to 8.32)


def join_body(stream, group, member, start=0, lease=0):
    return name(stream) + name(group) + name(member) + struct.pack("<BBHI", start, 0, 0, lease)


def test_stream_dumps_and_more(tensord):
    with Conn(tensord.port) as c:
        c.sock.sendall(EX["stream-create-req"])
        assert c.reply(2).raw == EX["stream-create-rep"]
        c.next_rid = 3
        js = c.ok(OP["STREAM_JOIN"], join_body("ev", "train", "w0"))
        assert struct.unpack("<QQQIIII", js) == (1, 1, 0, 0, 1, 0, 0)
        c.sock.sendall(EX["stream-append-req"])
        assert c.reply(4).raw == EX["stream-append-rep"]
        c.next_rid = 5
        st = c.ok(OP["STREAM_MARK"], name("ev") + struct.pack("<Q", 1))
        assert struct.unpack("<QQII", st) == (2, 1, 62, 2)
        c.sock.sendall(EX["stream-read-req"])
        assert c.reply(6).raw == EX["stream-read-rep"]
        c.next_rid = 7
        # ACK both: the floor moves to 3 and the credit is the whole window again
        ack = c.ok(OP["STREAM_ACK"], name("ev") + name("train") + name("w0") +
                   struct.pack("<QQI", 1, 2, 0))
        assert struct.unpack("<QQII", ack) == (2, 3, 0, 64)
        first, last, lost, got = entries(c.ok(OP["STREAM_RANGE"], name("ev") +
                                              struct.pack("<QII", 0, 10, 0)))
        assert (first, last, lost) == (1, 2, 0)
        assert [(h["id"], h["kind"], h["deliveries"], h["flags"]) for h, _ in got] == \
            [(1, 0, 0, 0), (2, 1, 0, 0)]
        info = decode_record(c.ok(OP["STREAM_INFO"], name("ev")))
        assert (info["first_id"], info["last_id"], info["entries"], info["window"]) == (1, 2, 2, 64)
        assert info["credit"] == 64 and info["groups"][0]["name"] == "train"
        assert info["groups"][0]["members"][0]["name"] == "w0"
        # a read with nothing new waits, then ends with n = 0
        first, last, lost, got = entries(c.ok(OP["STREAM_READ"], name("ev") + name("train") +
                                              name("w0") + struct.pack("<QII", 0, 4, 100)))
        assert got == [] and last == 2
        # back-pressure: a window of 1 with a live group
        c.ok(OP["STREAM_CREATE"], name("bp") + struct.pack("<QQIIII", 10, 0, 0, 1, 0, 0))
        c.ok(OP["STREAM_JOIN"], join_body("bp", "g", "m"))
        st = c.ok(OP["STREAM_APPEND"], name("bp") + int_record(1))
        assert struct.unpack("<QQII", st) == (1, 1, 0, 1)
        error_reply(c.call(OP["STREAM_APPEND"], name("bp") + int_record(2)), BACKPRESSURE)
        cr = c.ok(OP["STREAM_CREDIT"], name("bp") + struct.pack("<I", 0))
        assert struct.unpack_from("<I", cr, 36)[0] == 0
        # the member leaves: no live group, the credit is unlimited
        st = c.ok(OP["STREAM_LEAVE"], name("bp") + name("g") + name("m"))
        assert struct.unpack("<QQQIIIIII", st) == (1, 1, 64, 1, 1, 1, 2**32 - 1, 1, 0)
        # the kinds are one namespace
        error_reply(c.call(OP["PUT"], name("bp") + int_record(1)), INVALID)
        c.ok(OP["PUT"], name("plain") + int_record(1))
        error_reply(c.call(OP["STREAM_INFO"], name("plain")), INVALID)
        error_reply(c.call(OP["STREAM_INFO"], name("none")), NOT_FOUND)
        # WAIT on a stream answers with {last_id, n_entries}
        assert bin_state(c.ok(OP["WAIT"], name("ev") + struct.pack("<QI", 1, 0))) == (2, 2)


# ---------------------------------------------------------------------------------------------
# Replay tables (sections 8.33 to 8.38)


def test_table_dumps_and_more(tensord):
    with Conn(tensord.port) as c:
        c.sock.sendall(EX["table-create-req"])
        assert c.reply(2).raw == EX["table-create-rep"]
        c.sock.sendall(EX["table-insert-req"])
        assert c.reply(3).raw == EX["table-insert-rep"]
        c.sock.sendall(EX["table-sample-req"])
        rep = c.reply(4).raw
        age = u64_at(rep, 0x40)
        assert age < 5000
        assert rep == with_u64(EX["table-sample-rep"], 0x40, age)
        c.next_rid = 5
        # one more draw would leave the band: timeout 0 is TIMEOUT at once
        error_reply(c.call(OP["TABLE_SAMPLE"], name("rb") + struct.pack("<II", 1, 0)), TIMEOUT)
        st = c.ok(OP["TABLE_UPDATE"], name("rb") + struct.pack("<II", 2, 0) +
                  struct.pack("<Qd", 1, 5.0) + struct.pack("<Qd", 99, 1.0))
        assert struct.unpack("<QQQQII", st) == (0, 1, 1, 1, 1, 1)
        error_reply(c.call(OP["TABLE_UPDATE"], name("rb") + struct.pack("<II", 1, 0) +
                           struct.pack("<Qd", 1, -1.0)), INVALID)
        info = decode_record(c.ok(OP["TABLE_INFO"], name("rb")))
        assert (info["size"], info["inserts"], info["samples"], info["next_key"]) == (1, 1, 1, 2)
        assert info["sampler"] == "prioritized" and info["remover"] == "fifo"
        assert info["samples_per_insert"] == 1.0 and info["diff"] == 0.0
        st = c.ok(OP["TABLE_REMOVE"], name("rb") + struct.pack("<II", 2, 0) +
                  struct.pack("<QQ", 1, 7))
        assert struct.unpack("<QQQQII", st) == (0, 0, 1, 1, 1, 1)
        error_reply(c.call(OP["TABLE_INFO"], name("none")), NOT_FOUND)
        error_reply(c.call(OP["GET"], name("rb") + struct.pack("<I", 0)), INVALID)
        # a FIFO table draws its oldest item; LIST shows size, bytes and inserts
        c.ok(OP["TABLE_CREATE"], name("f") + struct.pack("<QQdddIBBH", 2, 1, 1.0, 0.0, 0.0, 0,
                                                          0, 2, 0))
        for v in (1, 2, 3):  # capacity 2: the third insert evicts the oldest
            st = c.ok(OP["TABLE_INSERT"], name("f") + struct.pack("<dII", 1.0, 0, 0) +
                      int_record(v))
            assert struct.unpack_from("<Q", st)[0] == v
        body = c.ok(OP["TABLE_SAMPLE"], name("f") + struct.pack("<II", 1, 0))
        size, n, res = struct.unpack_from("<QII", body)
        key, ln, prob, age, times, res2 = struct.unpack_from("<QQdQII", body, 16)
        assert (size, n, key, ln, prob, times, res2) == (2, 1, 2, 64, 1.0, 1, 0)
        assert body[align64(56):] == int_record(2)
        lst = c.ok(OP["LIST"])
        assert name("f") + struct.pack("<IQQ", 2, 128, 3) in lst


# ---------------------------------------------------------------------------------------------
# Parameter server (sections 8.45 to 8.50)


def test_ps_dumps_and_sync_steps(tensord):
    with Conn(tensord.port) as c, Conn(tensord.port) as c2:
        v0, _ = bin_state(c.ok(OP["PUT"], name("w") + encode_record(tensor_of(9, (2,), [0, 0]))))
        c.next_rid = 2
        c.sock.sendall(EX["ps-create-req"])
        rep = c.reply(2).raw
        delta = v0 - u64_at(EX["ps-create-rep"], 0x18)
        assert rep == shifted(EX["ps-create-rep"], [0x18], delta)
        # push A (the dump, base_version patched) waits for the second gradient of the step
        c.sock.sendall(shifted(EX["ps-push-req"], [0x1A], delta))
        assert c.waiting(3)
        grad = encode_record(tensor_of(9, (2,), [3.0, 4.0]))
        v1, n = bin_state(c2.ok(OP["PS_PUSH"], name("w") + struct.pack("<Qd", v0, 1.0) + grad))
        assert v1 > v0 and n == 0
        assert bin_state(c.reply(3).body) == (v1, 0)
        # p -= lr * mean(g): 0 - 0.5 * (2, 3)
        c.next_rid = 4
        ver, rem, recs = items(c.ok(OP["PS_PULL"], name("w") + struct.pack("<Q", 0)))
        assert (ver, rem) == (v1, 1)
        assert decode_record(recs[0]) == tensor_of(9, (2,), [-1.0, -1.5])
        # another step, then a gradient one step behind waits, one two steps behind is stale
        r1 = c.send(OP["PS_PUSH"], name("w") + struct.pack("<Qd", v1, 1.0) + grad)
        v2, _ = bin_state(c2.ok(OP["PS_PUSH"], name("w") + struct.pack("<Qd", v1, 1.0) + grad))
        assert bin_state(c.reply(r1).body) == (v2, 0)
        r2 = c.send(OP["PS_PUSH"], name("w") + struct.pack("<Qd", v1, 1.0) + grad)
        c.ok(OP["PING"])  # the connection's requests are handled in order: r2 is in first
        rep = c2.call(OP["PS_PUSH"], name("w") + struct.pack("<Qd", v0, 1.0) + grad)
        assert rep.status == STALE_GRADIENT and bin_state(rep.body) == (v2, 1)
        # PS_PULL not newer: the dump's layout
        pull = c2.call(OP["PS_PULL"], name("w") + struct.pack("<Q", v2))
        assert pull.body == shifted(EX["ps-pull-rep-not-newer"], [0x18], v2 -
                                    u64_at(EX["ps-pull-rep-not-newer"], 0x18))[24:]
        c2.ok(OP["PS_PUSH"], name("w") + struct.pack("<Qd", v2, 1.0) + grad)
        assert c.reply(r2).status == OK


def test_embedding_dumps(tensord):
    with Conn(tensord.port) as c:
        c.next_rid = 6
        c.sock.sendall(EX["emb-create-req"])
        rep = c.reply(6).raw
        ver = u64_at(rep, 0x18)
        assert rep == with_u64(EX["emb-create-rep"], 0x18, ver)
        c.sock.sendall(EX["emb-pull-req"])
        rep = c.reply(7).raw
        assert rep == with_u64(EX["emb-pull-rep"], 0x18, ver)
        c.sock.sendall(EX["emb-push-req"])
        rep = c.reply(8).raw
        ver2 = u64_at(rep, 0x18)
        assert ver2 > ver and rep == with_u64(EX["emb-push-rep"], 0x18, ver2)
        # SGD: row 7 -= 0.01 * grad
        c.next_rid = 9
        ids = encode_record(tensor_of(6, (1,), [7]))
        _, _, recs = items(c.ok(OP["EMB_PULL"], name("emb") + ids))
        old = struct.unpack("<4f", EX["emb-pull-rep"][0x98:0xA8])
        new = struct.unpack("<4f", decode_record(recs[0]).data)
        for o, g, n in zip(old, (0.5, -0.5, 1.0, -1.0), new):
            assert abs((o - 0.01 * g) - n) < 1e-6
        error_reply(c.call(OP["EMB_PULL"], name("emb") + encode_record(tensor_of(6, (1,), [-1]))),
                    INVALID)


def test_emb_create_reply_version_is_the_tables(tensord):
    """Section 8.48: "Reply: the bin state (the table's version, 0)"."""
    with Conn(tensord.port) as c:
        body = EX["emb-create-req"][24:]
        v1, n1 = bin_state(c.ok(OP["EMB_CREATE"], body))
        v2, n2 = bin_state(c.ok(OP["EMB_CREATE"], body))  # the same settings: nothing changes
        assert n1 == n2 == 0 and v1 == v2


# ---------------------------------------------------------------------------------------------
# Services (sections 8.51 to 8.54)


def svc_request(f):
    """Section 8.54: (call_id, timeout_ms, service name, record)."""
    call_id, timeout, res, rec_len = struct.unpack_from("<QIIQ", f.body)
    assert res == 0
    ln = f.body[24]
    svc = f.body[25:25 + ln]
    head = align64(25 + ln)
    assert f.body[25 + ln:head] == bytes(head - 25 - ln)
    rec = f.body[head:head + rec_len]
    decode_record(rec)
    assert f.body[head + rec_len:] == bytes(align64(rec_len) - rec_len)
    assert len(f.body) == head + align64(rec_len)
    return call_id, timeout, svc, rec


def test_service_dumps(tensord):
    with Conn(tensord.port) as srv, Conn(tensord.port) as caller:
        srv.sock.sendall(EX["svc-register-req"])
        assert srv.reply(2).raw == EX["svc-register-rep"]
        caller.sock.sendall(EX["svc-call-req"])
        push = srv.push(OP["SVC_REQUEST"])
        call_id, left = u64_at(push.raw, 0x18), struct.unpack_from("<I", push.raw, 0x20)[0]
        assert 1 <= left <= 1000
        expect = with_u64(EX["svc-request-push"], 0x18, call_id)
        expect = expect[:0x20] + struct.pack("<I", left) + expect[0x24:]
        assert push.raw == expect
        srv.sock.sendall(with_u64(EX["svc-reply-req"], 0x1F, call_id))
        assert srv.reply(3).raw == EX["svc-reply-rep"]
        assert caller.reply(2).raw == with_u64(EX["svc-call-rep"], 0x18, call_id)
        # the service's state counts the answered call
        srv.next_rid = 4
        st = srv.ok(OP["SVC_REGISTER"], name("double") + struct.pack("<II", 8, 0))
        assert struct.unpack("<IIQ", st) == (1, 0, 1)


def test_service_gone_dump(tensord):
    with Conn(tensord.port) as caller:
        srv = Conn(tensord.port)
        srv.ok(OP["SVC_REGISTER"], name("double") + struct.pack("<II", 8, 0))
        caller.next_rid = 4
        rid = caller.send(OP["SVC_CALL"], name("double") + struct.pack("<II", 1000, 0) +
                          int_record(21))
        srv.push(OP["SVC_REQUEST"])
        srv.close()
        assert caller.reply(rid).raw == EX["svc-call-rep-gone"]


def test_services(tensord):
    with Conn(tensord.port) as srv, Conn(tensord.port) as caller:
        body = int_record(1)
        # no server: NOT_FOUND; the caller's connection stays
        error_reply(caller.call(OP["SVC_CALL"], name("s") + struct.pack("<II", 1000, 0) + body),
                    NOT_FOUND)
        error_reply(caller.call(OP["SVC_CALL"], name("s") + struct.pack("<II", 0, 0) + body),
                    INVALID)
        error_reply(caller.call(OP["SVC_CALL"], name("s") + struct.pack("<II", 1000, 2) + body),
                    INVALID)
        error_reply(srv.call(OP["SVC_REGISTER"], name("s") + struct.pack("<II", 65537, 0)),
                    INVALID)
        error_reply(srv.call(OP["SVC_REGISTER"], name("s") + struct.pack("<II", 0, 0)), NOT_FOUND)
        # WAIT flag: the call waits for a server, then is handed to it at once
        rid = caller.send(OP["SVC_CALL"], name("s") + struct.pack("<II", 5000, 1) + body)
        assert caller.waiting(rid)
        st = srv.ok(OP["SVC_REGISTER"], name("s") + struct.pack("<II", 1, 0))
        assert struct.unpack("<IIQ", st)[0] == 1
        call_id, left, svc, rec = svc_request(srv.push(OP["SVC_REQUEST"]))
        assert svc == b"s" and rec == body and 1 <= left <= 5000
        # concurrency 1: a second call queues until the first is answered
        rid2 = caller.send(OP["SVC_CALL"], name("s") + struct.pack("<II", 5000, 0) + body)
        assert caller.waiting(rid2) and srv.nothing_arrives(0.1)
        # an error answer: the caller gets the server's status and message
        assert srv.ok(OP["SVC_REPLY"], name("s") + struct.pack("<QHHI", call_id, INVALID, 0, 0)
                      + b"bad input") == b""
        rep = caller.reply(rid)
        assert rep.status == INVALID and rep.body == b"bad input"
        call2, _, _, _ = svc_request(srv.push(OP["SVC_REQUEST"]))
        assert call2 != call_id
        # a call id this connection was not handed: NOT_FOUND; a reserved status: INVALID
        error_reply(srv.call(OP["SVC_REPLY"], name("s") + struct.pack("<QHHI", call_id, 0, 0, 0)
                             + body), NOT_FOUND)
        error_reply(srv.call(OP["SVC_REPLY"], name("s") + struct.pack("<QHHI", call2,
                                                                      VERSION_MISMATCH, 0, 0)
                             + b"x"), INVALID)
        answer = encode_record({"y": tensor_of(9, (2,), [1.0, 2.0])})
        srv.ok(OP["SVC_REPLY"], name("s") + struct.pack("<QHHI", call2, 0, 0, 0) + answer)
        ver, rem, recs = items(caller.reply(rid2).body)
        assert (ver, rem, recs) == (call2, 0, [answer])
        # a call with a timeout shorter than the server's work: TIMEOUT, the late answer dropped
        rid3 = caller.send(OP["SVC_CALL"], name("s") + struct.pack("<II", 300, 0) + body)
        call3, _, _, _ = svc_request(srv.push(OP["SVC_REQUEST"]))
        error_reply(caller.reply(rid3), TIMEOUT)
        assert srv.ok(OP["SVC_REPLY"], name("s") + struct.pack("<QHHI", call3, 0, 0, 0) +
                      body) == b""
        # the server's disconnect fails its in-flight calls with SERVICE_GONE
        rid4 = caller.send(OP["SVC_CALL"], name("s") + struct.pack("<II", 5000, 0) + body)
        svc_request(srv.push(OP["SVC_REQUEST"]))
        srv.close()
        error_reply(caller.reply(rid4), SERVICE_GONE, OP["SVC_CALL"], rid4)
        caller.ok(OP["PING"])


def test_svc_call_is_an_upload(tensord):
    """Section 12 lists SVC_CALL among the uploads: a body over 4096 bytes is not TOO_LARGE."""
    with Conn(tensord.port) as caller:
        big = encode_record(Blob(bytes(8000)))
        error_reply(caller.call(OP["SVC_CALL"], name("s") + struct.pack("<II", 1000, 0) + big),
                    NOT_FOUND)
        caller.ok(OP["PING"])


# ---------------------------------------------------------------------------------------------
# Compressed bodies (section 11), with blocks of literals only (a valid LZ4 block needs no
# compressor: one sequence of literals with no match)


def lz4_literals(raw):
    n = len(raw)
    token = min(n, 15) << 4
    out = bytearray([token])
    if n >= 15:
        rest = n - 15
        while rest >= 255:
            out.append(255)
            rest -= 255
        out.append(rest)
    return bytes(out) + raw


def compressed(raw):
    return struct.pack("<Q", len(raw)) + lz4_literals(raw)


def test_lz4_bodies(tensord):
    with Conn(tensord.port, hello_flags=0x01) as c:
        if c.hello_body[1] != 0x01:
            pytest.skip("this tensord was built without LZ4")
        rec = encode_record({"x": tensor_of(9, (100,), [1.5] * 100), "s": "z" * 40})
        ver, n = bin_state(c.ok(OP["PUT"], compressed(name("lz") + rec), flags=1))
        assert n == 1
        _, _, recs = items(c.ok(OP["PEEK"], name("lz") + struct.pack("<I", 0)))
        assert recs == [rec]
        # a control request may be compressed too; raw_len 0 is the block 00
        assert c.ok(OP["PING"], struct.pack("<Q", 0) + b"\x00", flags=1) == b""
        assert bin_state(c.ok(OP["DELETE"], compressed(name("lz")), flags=1)) == (ver + 1, 1)
    bad = [
        ("raw_len over 4096 for a control request",
         frame(OP["DELETE"], struct.pack("<Q", 4097) + b"\x00", rid=9, flags=1), TOO_LARGE),
        ("body under 9 bytes", frame(OP["PUT"], struct.pack("<Q", 3), rid=9, flags=1),
         BAD_REQUEST),
        ("block shorter than raw_len",
         frame(OP["PUT"], struct.pack("<Q", 10) + lz4_literals(b"\x01x" + b"TSR"), rid=9,
               flags=1), BAD_REQUEST),
        ("bytes after the block",
         frame(OP["DELETE"], compressed(name("x")) + b"\x00", rid=9, flags=1), BAD_REQUEST),
    ]
    for what, data, status in bad:
        with Conn(tensord.port, hello_flags=0x01) as c:
            c.sock.sendall(data)
            rep = c.read_frame()
            error_reply(rep, status, data[2], 9)
            assert c.closed_by_server(), what


# ---------------------------------------------------------------------------------------------
# The other uploads of section 12 (PS_PUSH, EMB_PULL, EMB_PUSH, SVC_CALL, SVC_REPLY)

UPLOADS_OVER_4096 = [
    ("PS_PUSH", lambda rec: name("nop") + struct.pack("<Qd", 0, 1.0) + rec, NOT_FOUND),
    ("EMB_PULL", lambda rec: name("nop") + rec, NOT_FOUND),
    ("EMB_PUSH", lambda rec: name("nop") + struct.pack("<d", 1.0) + rec, NOT_FOUND),
    ("SVC_CALL", lambda rec: name("nop") + struct.pack("<II", 1000, 0) + rec, NOT_FOUND),
    ("SVC_REPLY", lambda rec: name("nop") + struct.pack("<QHHI", 5, 0, 0, 0) + rec, NOT_FOUND),
]


@pytest.mark.parametrize("op,body,status", UPLOADS_OVER_4096, ids=[u[0] for u in UPLOADS_OVER_4096])
def test_uploads_over_4096(tensord, op, body, status):
    """Section 12: these are uploads, held to max_body, not to the 4096 bytes of control frames;
    their records are validated (BAD_RECORD closes, section 13)."""
    with Conn(tensord.port) as c:
        big = encode_record(Blob(bytes(8000)))
        error_reply(c.call(OP[op], body(big)), status)
        c.ok(OP["PING"])
        bad = bytearray(body(int_record(1)))
        bad[-64] ^= 0xFF  # the record's magic
        c.sock.sendall(frame(OP[op], bytes(bad), rid=77))
        error_reply(c.read_frame(), BAD_RECORD, OP[op], 77)
        assert c.closed_by_server()


# ---------------------------------------------------------------------------------------------
# Connection limits, deadlines and the stop (sections 4, 5, 12, 13)


def test_hello_deadline(start_tensord):
    d = start_tensord("--hello-timeout", "200")
    with Conn(d.port, hello=False) as c:
        f = c.read_frame(5.0)
        assert (f.opcode, f.rid, f.status) == (0, 0, TIMEOUT)
        assert c.closed_by_server()


def test_max_clients(start_tensord):
    d = start_tensord("--max-clients", "1")
    with Conn(d.port) as a:
        a.ok(OP["PING"])
        with Conn(d.port, hello=False) as b:
            # "sent at once to a new connection, opcode 0, or in reply to a HELLO"
            b.sock.sendall(frame(OP["HELLO"], struct.pack("<BBH", 1, 0, 0), rid=1))
            f = b.read_frame()
            assert f.status == 10 and (f.opcode, f.rid) in ((0, 0), (OP["HELLO"], 1)), f
            assert b.closed_by_server()
        a.ok(OP["PING"])


def test_max_unauth_clients(start_tensord):
    d = start_tensord("--max-unauth-clients", "1")
    with Conn(d.port, hello=False) as old:
        old.sock.sendall(b"")
        time.sleep(0.1)
        with Conn(d.port) as new:  # the newer connection gets in
            new.ok(OP["PING"])
        f = old.read_frame()
        assert (f.opcode, f.rid, f.status) == (0, 0, 10)
        assert old.closed_by_server()


def test_body_deadline(start_tensord):
    d = start_tensord("--body-timeout", "1")
    with Conn(d.port) as c:
        c.sock.sendall(frame(OP["PING"])[:10])
        f = c.read_frame(5.0)
        assert (f.opcode, f.rid, f.status) == (0, 0, TIMEOUT)
        assert c.closed_by_server()


def test_shutdown(start_tensord):
    """Section 13: pending requests get SHUTTING_DOWN, then the frame with opcode 0."""
    d = start_tensord()
    c = Conn(d.port)
    try:
        rid = c.send(OP["WAIT"], name("never") + struct.pack("<QI", 0, 60000))
        assert c.waiting(rid)
        d.proc.send_signal(15)
        rep = c.reply(rid)
        error_reply(rep, 15, OP["WAIT"], rid)
        last = c.read_frame()
        assert (last.opcode, last.rid, last.status) == (0, 0, 15)
        assert last.body == b"tensord is shutting down"
        assert c.closed_by_server()
    finally:
        c.close()


# ---------------------------------------------------------------------------------------------
# More of what sections 8.23 to 8.54 promise


def test_streams_and_tables_as_bins(tensord):
    """Streams and tables in LIST, WAIT, LISTEN and DELETE (sections 8.23 to 8.38)."""
    with Conn(tensord.port) as c:
        c.ok(OP["STREAM_CREATE"], name("s") + struct.pack("<QQIIII", 2, 0, 0, 0, 0, 0))
        assert bin_state(c.ok(OP["LISTEN"], name("s"))) == (0, 0)
        for i in range(3):  # max_entries 2: the first entry is dropped by the third append
            st = c.ok(OP["STREAM_APPEND"], name("s") + int_record(i))
            assert struct.unpack("<QQII", st) == (i + 1, max(1, i), 2**32 - 1, min(i + 1, 2))
        c.ok(OP["STREAM_MARK"], name("s") + struct.pack("<Q", 9))
        for i in range(4):
            f = c.push(OP["NOTIFY"])
            assert struct.unpack_from("<QIBB", f.body) == (i + 1, min(i + 1, 2), 2, 0)
        lst = c.ok(OP["LIST"])
        assert name("s") + struct.pack("<IQQ", 2, 64, 4) in lst
        info = decode_record(c.ok(OP["STREAM_INFO"], name("s")))
        assert info["credit"] == -1 and info["first_id"] == 3
        assert bin_state(c.ok(OP["DELETE"], name("s"))) == (4, 2)
        f = c.push(OP["NOTIFY"])
        assert struct.unpack_from("<QIBB", f.body)[1:3] == (0, 4)
        c.ok(OP["TABLE_CREATE"], name("t") + struct.pack("<QQdddIBBH", 4, 1, 1.0, 0.0, 1.0, 0,
                                                          0, 0, 0))
        c.ok(OP["LISTEN"], name("t"))
        c.ok(OP["TABLE_INSERT"], name("t") + struct.pack("<dII", 1.0, 0, 0) + int_record(1))
        c.ok(OP["TABLE_INSERT"], name("t") + struct.pack("<dII", 2.0, 0, 0) + int_record(2))
        assert bin_state(c.ok(OP["DELETE"], name("t"))) == (2, 2)
        f = c.push(OP["NOTIFY"])  # only the DELETE of a table notifies
        assert struct.unpack_from("<QIBB", f.body) == (2, 0, 4, 0) and f.body[14:] == name("t")
        # MGET naming a stream is INVALID as a whole
        c.ok(OP["STREAM_CREATE"], name("s2") + struct.pack("<QQIIII", 2, 0, 0, 0, 0, 0))
        error_reply(c.call(OP["MGET"], struct.pack("<II", 2, 0) + name("x") + name("s2")),
                    INVALID)


def test_services_more(start_tensord):
    d = start_tensord("--max-watch", "1")
    with Conn(d.port) as srv, Conn(d.port) as caller, Conn(d.port) as other:
        body = int_record(1)
        srv.ok(OP["SVC_REGISTER"], name("a") + struct.pack("<II", 1, 0))
        srv.ok(OP["SVC_REGISTER"], name("b") + struct.pack("<II", 1, 0))
        ra = caller.send(OP["SVC_CALL"], name("a") + struct.pack("<II", 5000, 0) + body)
        call_a, _, _, _ = svc_request(srv.push(OP["SVC_REQUEST"]))
        # past --max-watch (1): TOO_MANY_CLIENTS, the connection stays
        error_reply(caller.call(OP["SVC_CALL"], name("a") + struct.pack("<II", 5000, 0) + body),
                    10)
        caller.ok(OP["PING"])
        # an answer naming another service than the call's is INVALID
        error_reply(srv.call(OP["SVC_REPLY"], name("b") + struct.pack("<QHHI", call_a, 0, 0, 0) +
                             body), INVALID)
        # a call queued behind the held one, then the server leaves: both SERVICE_GONE
        rb = other.send(OP["SVC_CALL"], name("a") + struct.pack("<II", 5000, 0) + body)
        assert other.waiting(rb)
        srv.close()
        error_reply(caller.reply(ra), SERVICE_GONE, OP["SVC_CALL"], ra)
        error_reply(other.reply(rb), SERVICE_GONE, OP["SVC_CALL"], rb)
        stats = decode_record(caller.ok(OP["STATS"]))
        assert stats["service_calls_gone"] == 2 and stats["service_servers"] == 0


def test_svc_register_zero_keeps_the_held_call(tensord):
    """Section 8.51: concurrency 0 ends the registration; the calls it holds may be answered."""
    with Conn(tensord.port) as srv, Conn(tensord.port) as caller:
        body = int_record(3)
        srv.ok(OP["SVC_REGISTER"], name("z") + struct.pack("<II", 2, 0))
        rid = caller.send(OP["SVC_CALL"], name("z") + struct.pack("<II", 5000, 0) + body)
        call, _, _, _ = svc_request(srv.push(OP["SVC_REQUEST"]))
        st = srv.ok(OP["SVC_REGISTER"], name("z") + struct.pack("<II", 0, 0))
        assert struct.unpack("<IIQ", st)[:2] == (0, 0)
        srv.ok(OP["SVC_REPLY"], name("z") + struct.pack("<QHHI", call, 0, 0, 0) + body)
        assert items(caller.reply(rid).body)[2] == [body]
        error_reply(caller.call(OP["SVC_CALL"], name("z") + struct.pack("<II", 500, 0) + body),
                    NOT_FOUND)


def test_watch_limit_and_barrier_timeout(start_tensord):
    d = start_tensord("--max-watch", "1")
    with Conn(d.port) as c:
        rid = c.send(OP["WAIT"], name("w") + struct.pack("<QI", 0, 5000))
        error_reply(c.call(OP["WAIT"], name("w") + struct.pack("<QI", 0, 5000)), INVALID)
        error_reply(c.call(OP["LISTEN"], name("w")), INVALID)
        c.ok(OP["PUT"], name("w") + int_record(1))
        assert c.reply(rid).status == OK
        error_reply(c.call(OP["BARRIER"], name("b") + struct.pack("<II", 2, 100)), TIMEOUT)
        error_reply(c.call(OP["BARRIER"], name("b") + struct.pack("<II", 0, 100)), INVALID)


def test_ps_more(tensord):
    with Conn(tensord.port) as c:
        settings = struct.pack("<BBBBIII4d", 1, 0, 0, 0, 1, 0, 0, 0.1, 0.9, 0.999, 1e-8)
        error_reply(c.call(OP["PS_CREATE"], name("p") + settings), NOT_FOUND)
        c.ok(OP["PUT"], name("p") + encode_record(tensor_of(9, (3,), [1.0, 1.0, 1.0])))
        v0, n = bin_state(c.ok(OP["PS_CREATE"], name("p") + settings))
        assert n == 1
        keep = struct.pack("<BBBBIII4d", 1, 0, 2, 0, 1, 0, 0, 0.1, 0.9, 0.999, 1e-8)
        assert bin_state(c.ok(OP["PS_CREATE"], name("p") + keep)) == (v0, 1)
        other = struct.pack("<BBBBIII4d", 1, 0, 2, 0, 1, 0, 0, 0.2, 0.9, 0.999, 1e-8)
        error_reply(c.call(OP["PS_CREATE"], name("p") + other), INVALID)
        # async SGD: one step per push
        g = encode_record(tensor_of(9, (3,), [1.0, 2.0, 3.0]))
        v1, n = bin_state(c.ok(OP["PS_PUSH"], name("p") + struct.pack("<Qd", 0, 1.0) + g))
        assert v1 > v0 and n == 0
        _, _, recs = items(c.ok(OP["PS_PULL"], name("p") + struct.pack("<Q", v0)))
        got = struct.unpack("<3f", decode_record(recs[0]).data)
        assert all(abs(a - b) < 1e-6 for a, b in zip(got, (0.9, 0.8, 0.7)))
        bad = encode_record(tensor_of(9, (2,), [1.0, 2.0]))
        error_reply(c.call(OP["PS_PUSH"], name("p") + struct.pack("<Qd", 0, 1.0) + bad), INVALID)
        error_reply(c.call(OP["PS_PUSH"], name("q") + struct.pack("<Qd", 0, 1.0) + g), NOT_FOUND)
        error_reply(c.call(OP["PS_PULL"], name("q") + struct.pack("<Q", 0)), NOT_FOUND)
        ids = encode_record(tensor_of(6, (1,), [0]))
        error_reply(c.call(OP["EMB_PULL"], name("noemb") + ids), NOT_FOUND)


# ---------------------------------------------------------------------------------------------
# By reference (sections 8.15 to 8.18): the ref examples of section 15 on the unix socket


def recv_frame_with_fds(sock, timeout=IO_TIMEOUT_S):
    """One frame and the descriptors that came with it (SCM_RIGHTS)."""
    deadline = time.monotonic() + timeout
    data, fds = b"", []
    need = 24
    for _ in range(MAX_FRAMES_SCANNED):
        if len(data) >= need:
            break
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk, anc, _, _ = sock.recvmsg(need - len(data), socket.CMSG_SPACE(16 * 4))
        if not chunk:
            raise Closed()
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(payload[:len(payload) - len(payload) % 4])
                fds.extend(a)
        data += chunk
        if len(data) >= 24:
            need = 24 + HEADER.unpack_from(data)[8]
    return Frame(data), fds


def test_by_reference_dumps(tensord):
    if not hasattr(os, "memfd_create"):
        pytest.skip("no memfd_create")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(IO_TIMEOUT_S)
    s.connect(tensord.unix_path)
    fd = os.memfd_create("rec", os.MFD_ALLOW_SEALING)
    got_fds = []
    try:
        s.sendall(EX["hello-fds-req"])
        rep, _ = recv_frame_with_fds(s)
        assert rep.raw[:0x28] == EX["hello-fds-rep"][:0x28]
        record = encode_record({"t": Tensor(2, (4194304,), bytes(range(256)) * 16384)})
        assert len(record) == 4194368
        os.write(fd, record)
        os.ftruncate(fd, 4198400)
        s.sendmsg([EX["put-fd-req"]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                        array.array("i", [fd]))])
        rep, _ = recv_frame_with_fds(s)
        delta = u64_at(rep.raw, 0x18) - u64_at(EX["put-fd-rep"], 0x18)
        assert rep.raw == shifted(EX["put-fd-rep"], [0x18], delta)
        # the server sealed the memfd: the writer cannot change it any more
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        s.sendall(frame(OP["APPEND"], name("frames") + int_record(41), rid=3))
        rep, _ = recv_frame_with_fds(s)
        assert bin_state(rep.body) == (u64_at(EX["put-fd-rep"], 0x18) + delta + 1, 2)
        s.sendall(EX["peek-ref-req"])
        rep, got_fds = recv_frame_with_fds(s)
        assert rep.raw == shifted(EX["peek-ref-rep"], [0x18], delta)
        assert len(got_fds) == 1
        st = os.fstat(got_fds[0])
        assert st.st_size == 4198400
        with mmap.mmap(got_fds[0], 4198400, mmap.MAP_SHARED, mmap.PROT_READ) as m:
            assert m[:len(record)] == record
        if hasattr(fcntl, "F_GET_SEALS"):
            seals = fcntl.fcntl(got_fds[0], fcntl.F_GET_SEALS)
            assert seals & fcntl.F_SEAL_WRITE and seals & fcntl.F_SEAL_GROW
    finally:
        for f in got_fds:
            os.close(f)
        os.close(fd)
        s.close()


# ---------------------------------------------------------------------------------------------
# Refusals that keep the connection, and malformed bodies that close it, request by request

TABLE_OK = struct.pack("<QQdddIBBH", 4, 1, 1.0, 0.0, 1.0, 0, 0, 0, 0)
PS_OK = struct.pack("<BBBBIII4d", 1, 0, 0, 0, 1, 0, 0, 0.1, 0.9, 0.999, 1e-8)
EMB_OK = struct.pack("<IBBHQQ5d", 4, 1, 0, 0, 1, 0, 0.1, 0.9, 0.999, 1e-8, 0.0)


def setup_kinds(c):
    c.ok(OP["PUT"], name("plain") + int_record(1))
    c.ok(OP["PUT"], name("f32") + encode_record(tensor_of(9, (2,), [1.0, 2.0])))
    c.ok(OP["STREAM_CREATE"], name("st") + struct.pack("<QQIIII", 8, 0, 0, 0, 0, 0))
    c.ok(OP["TABLE_CREATE"], name("tb") + TABLE_OK)
    c.ok(OP["EMB_CREATE"], name("em") + EMB_OK)


REFUSALS = [
    # (what, opcode, body, status): each answered with the status, the connection kept
    ("ADD on a stream", "ADD", name("st") + struct.pack("<q", 1), INVALID),
    ("PUT_IF on a stream", "PUT_IF", name("st") + struct.pack("<Q", 0) + int_record(1), INVALID),
    ("TAKE on a stream", "TAKE", name("st") + struct.pack("<II", 0, 0), INVALID),
    ("APPEND on a table", "APPEND", name("tb") + int_record(1), INVALID),
    ("STREAM_APPEND on a plain bin", "STREAM_APPEND", name("plain") + int_record(1), INVALID),
    ("STREAM_APPEND on nothing", "STREAM_APPEND", name("none") + int_record(1), NOT_FOUND),
    ("TABLE_INSERT on nothing", "TABLE_INSERT",
     name("none") + struct.pack("<dII", 1.0, 0, 0) + int_record(1), NOT_FOUND),
    ("TABLE_INSERT NaN priority", "TABLE_INSERT",
     name("tb") + struct.pack("<dII", float("nan"), 0, 0) + int_record(1), INVALID),
    ("TABLE_SAMPLE n 0", "TABLE_SAMPLE", name("tb") + struct.pack("<II", 0, 0), INVALID),
    ("TABLE_CREATE name taken", "TABLE_CREATE", name("plain") + TABLE_OK, INVALID),
    ("TABLE_CREATE small error_buffer", "TABLE_CREATE",
     name("t2") + struct.pack("<QQdddIBBH", 4, 1, 2.0, 1.5, 1.0, 0, 0, 0, 0), INVALID),
    ("TABLE_CREATE capacity 0", "TABLE_CREATE",
     name("t2") + struct.pack("<QQdddIBBH", 0, 1, 1.0, 0.0, 1.0, 0, 0, 0, 0), INVALID),
    ("STREAM_CREATE window above max_entries", "STREAM_CREATE",
     name("s3") + struct.pack("<QQIIII", 4, 0, 0, 5, 0, 0), INVALID),
    ("STREAM_CREATE on a plain bin", "STREAM_CREATE",
     name("plain") + struct.pack("<QQIIII", 4, 0, 0, 0, 0, 0), INVALID),
    ("STREAM_JOIN start 2", "STREAM_JOIN", join_body("st", "g", "m", start=2), INVALID),
    ("STREAM_READ unjoined", "STREAM_READ",
     name("st") + name("g") + name("m") + struct.pack("<QII", 0, 1, 0), NOT_FOUND),
    ("STREAM_RANGE max_entries 0", "STREAM_RANGE", name("st") + struct.pack("<QII", 0, 0, 0),
     INVALID),
    ("STREAM_RANGE after_id past last_id", "STREAM_RANGE",
     name("st") + struct.pack("<QII", 5, 1, 0), INVALID),
    ("STREAM_LEAVE unknown group", "STREAM_LEAVE", name("st") + name("g") + name(""), NOT_FOUND),
    ("MGET of a table", "MGET", struct.pack("<II", 1, 0) + name("tb"), INVALID),
    ("BARRIER parties over 65536", "BARRIER", name("b") + struct.pack("<II", 65537, 0), INVALID),
    ("PS_CREATE on an int", "PS_CREATE", name("plain") + PS_OK, INVALID),
    ("PS_CREATE unknown flag", "PS_CREATE",
     name("f32") + struct.pack("<BBBBIII4d", 1, 0, 4, 0, 1, 0, 0, 0.1, 0.9, 0.999, 1e-8),
     INVALID),
    ("PS_PUSH on a bin that is no parameter", "PS_PUSH",
     name("f32") + struct.pack("<Qd", 0, 1.0) + encode_record(tensor_of(9, (2,), [1, 1])),
     NOT_FOUND),
    ("EMB_CREATE other settings", "EMB_CREATE",
     name("em") + struct.pack("<IBBHQQ5d", 8, 1, 0, 0, 1, 0, 0.1, 0.9, 0.999, 1e-8, 0.0), INVALID),
    ("EMB_CREATE dim 0", "EMB_CREATE",
     name("e2") + struct.pack("<IBBHQQ5d", 0, 1, 0, 0, 1, 0, 0.1, 0.9, 0.999, 1e-8, 0.0), INVALID),
    ("EMB_PUSH NaN", "EMB_PUSH", name("em") + struct.pack("<d", 1.0) + encode_record(
        [tensor_of(6, (1,), [1]), tensor_of(9, (1, 4), [float("nan"), 0, 0, 0])]), INVALID),
    ("EMB_PUSH one tensor", "EMB_PUSH", name("em") + struct.pack("<d", 1.0) +
     encode_record(tensor_of(6, (1,), [1])), INVALID),
    ("SVC_CALL timeout over 24 h", "SVC_CALL",
     name("svc") + struct.pack("<II", 86400001, 0) + int_record(1), INVALID),
    ("SVC_CALL empty name", "SVC_CALL", name("") + struct.pack("<II", 100, 0) + int_record(1),
     INVALID),
    ("SVC_REGISTER flags", "SVC_REGISTER", name("svc") + struct.pack("<II", 1, 1), INVALID),
    ("SVC_REGISTER empty name", "SVC_REGISTER", name("") + struct.pack("<II", 1, 0), INVALID),
    ("SVC_REPLY status 11", "SVC_REPLY", name("svc") + struct.pack("<QHHI", 1, 11, 0, 0) + b"m",
     INVALID),
    ("SVC_REPLY status 23", "SVC_REPLY", name("svc") + struct.pack("<QHHI", 1, 23, 0, 0) + b"m",
     INVALID),
    ("SVC_REPLY reserved u16", "SVC_REPLY",
     name("svc") + struct.pack("<QHHI", 1, 0, 1, 0) + int_record(1), INVALID),
    ("SVC_REPLY reserved u32", "SVC_REPLY",
     name("svc") + struct.pack("<QHHI", 1, 0, 0, 1) + int_record(1), INVALID),
    ("SVC_REPLY of no call", "SVC_REPLY",
     name("svc") + struct.pack("<QHHI", 1, 0, 0, 0) + int_record(1), NOT_FOUND),
    ("TENSOR_BIN on a bin", "TENSOR_BIN" if "TENSOR_BIN" in OP else 0x12,
     name("plain") + struct.pack("<BBHQ", 9, 1, 0, 4), INVALID),
    ("TENSOR_BIN ndim 0", 0x12, name("tbin") + struct.pack("<BBH", 9, 0, 0), INVALID),
]


@pytest.mark.parametrize("what,op,body,status", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_keep_the_connection(tensord, what, op, body, status):
    with Conn(tensord.port) as c:
        setup_kinds(c)
        code = OP[op] if isinstance(op, str) else op
        rep = c.call(code, body)
        error_reply(rep, status, code)
        c.ok(OP["PING"])


MALFORMED = [
    # (what, opcode, body): BAD_REQUEST and the connection closes
    ("TABLE_CREATE reserved", "TABLE_CREATE",
     name("t9") + struct.pack("<QQdddIBBH", 4, 1, 1.0, 0.0, 1.0, 0, 0, 0, 1)),
    ("TABLE_INSERT reserved", "TABLE_INSERT",
     name("tb") + struct.pack("<dII", 1.0, 0, 1) + int_record(1)),
    ("TABLE_UPDATE short", "TABLE_UPDATE", name("tb") + struct.pack("<II", 2, 0) + bytes(16)),
    ("TABLE_REMOVE reserved", "TABLE_REMOVE", name("tb") + struct.pack("<II", 0, 1)),
    ("PUT_IF ends in its fixed fields", "PUT_IF", name("x") + bytes(5)),
    ("MGET n 0", "MGET", struct.pack("<II", 0, 0)),
    ("MGET n 257", "MGET", struct.pack("<II", 257, 0) + name("") * 257),
    ("MGET bytes after the names", "MGET", struct.pack("<II", 1, 0) + name("a") + b"\0"),
    ("PS_CREATE reserved", "PS_CREATE",
     name("f32") + struct.pack("<BBBBIII4d", 1, 0, 0, 1, 1, 0, 0, 0.1, 0.9, 0.999, 1e-8)),
    ("PS_CREATE short", "PS_CREATE", name("f32") + PS_OK[:-1]),
    ("EMB_CREATE reserved", "EMB_CREATE",
     name("em") + struct.pack("<IBBHQQ5d", 4, 1, 0, 1, 1, 0, 0.1, 0.9, 0.999, 1e-8, 0.0)),
    ("STREAM_CREATE short", "STREAM_CREATE", name("s") + bytes(31)),
    ("STREAM_JOIN reserved", "STREAM_JOIN",
     name("st") + name("g") + name("m") + struct.pack("<BBHI", 0, 1, 0, 0)),
    ("STREAM_READ empty member", "STREAM_READ",
     name("st") + name("g") + name("") + struct.pack("<QII", 0, 1, 0)),
    ("SVC_REGISTER short", "SVC_REGISTER", name("svc") + bytes(7)),
    ("SVC_REPLY message over 1024", "SVC_REPLY",
     name("svc") + struct.pack("<QHHI", 1, INVALID, 0, 0) + b"m" * 1025),
    ("SHARD_MAP with a body", "SHARD_MAP", b"\0"),
    ("PING with a body", "PING", b"\0"),
    ("TENSOR_BIN dims missing", 0x12, name("tbin") + struct.pack("<BBHQ", 9, 2, 0, 4)),
]


@pytest.mark.parametrize("what,op,body", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_bodies_close(tensord, what, op, body):
    with Conn(tensord.port) as c:
        setup_kinds(c)
        code = OP[op] if isinstance(op, str) else op
        rid = c.send(code, body)
        error_reply(c.reply(rid), BAD_REQUEST, code, rid)
        assert c.closed_by_server()


def test_more_promises(start_tensord):
    d = start_tensord("--max-watch", "1")
    with Conn(d.port) as a, Conn(d.port) as b:
        # LISTEN again at the limit is answered like the first
        assert bin_state(a.ok(OP["LISTEN"], name("x"))) == (0, 0)
        assert bin_state(a.ok(OP["LISTEN"], name("x"))) == (0, 0)
        a.ok(OP["UNLISTEN"], name("x"))
        # a DELETE leaves a TAKE waiting for the next items
        b.ok(OP["PUT"], name("q") + int_record(1))
        b.ok(OP["DELETE"], name("q"))
        rid = a.send(OP["TAKE"], name("q") + struct.pack("<II", 0, 5000))
        assert a.waiting(rid)
        b.ok(OP["PUT"], name("q") + int_record(2))
        b.ok(OP["DELETE"], name("q"))
        rep = a.reply(rid)
        assert rep.status == OK and items(rep.body)[2] == [int_record(2)]
        # a barrier is reusable: the second release is generation 2
        for gen in (1, 2):
            rid = a.send(OP["BARRIER"], name("b") + struct.pack("<II", 2, 5000))
            assert a.waiting(rid)
            assert b.ok(OP["BARRIER"], name("b") + struct.pack("<II", 2, 5000)) == \
                struct.pack("<QII", gen, 2, 0)
            assert a.reply(rid).body == struct.pack("<QII", gen, 2, 0)


def test_stream_redelivery(tensord):
    """Sections 8.27 to 8.29: a member that joins again gets its pending entries again."""
    with Conn(tensord.port) as c:
        c.ok(OP["STREAM_CREATE"], name("r") + struct.pack("<QQIIII", 8, 0, 0, 0, 0, 0))
        for i in range(2):
            c.ok(OP["STREAM_APPEND"], name("r") + int_record(i))
        rd = name("r") + name("g") + name("m")
        c.ok(OP["STREAM_JOIN"], join_body("r", "g", "m"))
        _, _, _, got = entries(c.ok(OP["STREAM_READ"], rd + struct.pack("<QII", 0, 8, 0)))
        assert [h["id"] for h, _ in got] == [1, 2]
        ack = c.ok(OP["STREAM_ACK"], rd + struct.pack("<QQI", 2, 2, 5))
        assert struct.unpack("<QQII", ack)[0] == 0  # rows: nothing acknowledged
        error_reply(c.call(OP["STREAM_ACK"], rd + struct.pack("<QQI", 1, 2, 5)), INVALID)
        error_reply(c.call(OP["STREAM_READ"], rd + struct.pack("<QII", 3, 1, 0)), INVALID)
        js = struct.unpack("<QQQIIII", c.ok(OP["STREAM_JOIN"], join_body("r", "g", "m")))
        assert js[:6] == (3, 1, 0, 2, 1, 0)  # pending 2; rows_done of the oldest (id 1) is 0
        _, _, _, got = entries(c.ok(OP["STREAM_READ"], rd + struct.pack("<QII", 1, 8, 0)))
        assert [(h["id"], h["deliveries"], h["flags"], h["rows_done"]) for h, _ in got] == \
            [(2, 2, 1, 5)]
        info = decode_record(c.ok(OP["STREAM_INFO"], name("r")))
        assert info["groups"][0]["pending"] == 1 and info["groups"][0]["floor"] == 2


def test_changes_that_take_versions(tensord):
    """Section 9: the change counter (STATS `version`) moves for the changes it lists."""
    with Conn(tensord.port) as c:
        def counter():
            return decode_record(c.ok(OP["STATS"]))["version"]

        def takes(op, body, expect=True):
            before = counter()
            rep = c.ok(OP[op], body)
            assert counter() == before + (1 if expect else 0), op
            return rep

        v0, _ = bin_state(takes("PUT", name("w") + encode_record(tensor_of(9, (2,), [0, 0]))))
        # new settings move the counter (the next snapshot must hold them), not the bin's version
        assert bin_state(takes("PS_CREATE", name("w") + PS_OK)) == (v0, 1)
        keep = PS_OK[:2] + b"\x02" + PS_OK[3:]
        assert bin_state(takes("PS_CREATE", name("w") + keep, expect=False)) == (v0, 1)
        v, _ = bin_state(takes("PS_PUSH", name("w") + struct.pack("<Qd", 0, 1.0) +
                               encode_record(tensor_of(9, (2,), [1, 1]))))
        assert v == counter()
        v, _ = bin_state(takes("EMB_CREATE", name("em") + EMB_OK))
        assert v == counter()
        takes("EMB_CREATE", name("em") + EMB_OK, expect=False)
        takes("EMB_PULL", name("em") + encode_record(tensor_of(6, (1,), [3])), expect=False)
        takes("EMB_PUSH", name("em") + struct.pack("<d", 1.0) + encode_record(
            [tensor_of(6, (1,), [3]), tensor_of(9, (1, 4), [1, 1, 1, 1])]))
        # these move the counter without giving its value to a bin (a step per item touched)
        takes("TABLE_CREATE", name("tb") + TABLE_OK)
        for op, body in [
                ("TABLE_INSERT", name("tb") + struct.pack("<dII", 1.0, 0, 0) + int_record(1)),
                ("TABLE_SAMPLE", name("tb") + struct.pack("<II", 1, 0)),
                ("TABLE_UPDATE", name("tb") + struct.pack("<II", 1, 0) + struct.pack("<Qd", 1, 2)),
                ("TABLE_REMOVE", name("tb") + struct.pack("<II", 1, 0) + struct.pack("<Q", 1))]:
            takes(op, body)
        for op, body in [
                ("BARRIER", name("b") + struct.pack("<II", 1, 0)),
                ("SVC_REGISTER", name("s") + struct.pack("<II", 1, 0))]:
            takes(op, body, expect=False)
        takes("DELETE", name("tb"))
        rd = name("st") + name("g") + name("m")
        for op, body in [
                ("STREAM_CREATE", name("st") + struct.pack("<QQIIII", 8, 0, 0, 0, 0, 0)),
                ("STREAM_APPEND", name("st") + int_record(1)),
                ("STREAM_MARK", name("st") + struct.pack("<Q", 1)),
                ("STREAM_JOIN", join_body("st", "g", "m")),
                ("STREAM_READ", rd + struct.pack("<QII", 0, 8, 0)),
                ("STREAM_READ", rd + struct.pack("<QII", 0, 8, 0)),  # hands out nothing
                ("STREAM_ACK", rd + struct.pack("<QQI", 1, 2, 0)),
                ("STREAM_LEAVE", rd),
                ("DELETE", name("st"))]:
            takes(op, body)
        takes("DELETE", name("none"), expect=False)
        takes("PEEK", name("w") + struct.pack("<I", 0), expect=False)
        takes("ADD", name("n") + struct.pack("<q", 1))


# ---------------------------------------------------------------------------------------------
# Pipelining, memory limits, waits on the server (sections 6, 8.3, 8.8, 8.26, 8.33 to 8.35)


def test_pipelining_and_big_list(tensord):
    """Section 6: replies in request order; section 8.8: a LIST of 4096 bins or more is built
    off the loop and keeps its place among the connection's replies."""
    n_bins = 4100
    with Conn(tensord.port) as c:
        rec = int_record(5)
        data = b"".join(frame(OP["PUT"], name("b%05d" % i) + rec, rid=1000 + i)
                        for i in range(n_bins))
        data += frame(OP["LIST"], rid=50)
        data += frame(OP["GET"], name("b00000") + struct.pack("<I", 0), rid=51)
        data += frame(OP["PING"], rid=52)
        c.sock.sendall(data)
        rids = []
        for _ in range(n_bins + 3):
            f = c.read_frame()
            assert f.status == OK, f
            rids.append(f.rid)
            if f.rid == 50:
                body = f.body
        assert rids == list(range(1000, 1000 + n_bins)) + [50, 51, 52]
        assert struct.unpack_from("<II", body) == (n_bins, 0)
        # every PUT before the LIST is in it, sorted, and the GET after it is not
        first = body[8:8 + 1 + 6]
        assert first == name("b00000") and len(body) == 8 + n_bins * (1 + 6 + 20)


def test_memory_limit_keeps_the_connection(start_tensord):
    d = start_tensord("--max-memory", "4m")
    with Conn(d.port) as c:
        big = encode_record(Blob(bytes(8 << 20)))
        rep = c.call(OP["PUT"], name("big") + big)
        error_reply(rep, 6, OP["PUT"])
        c.ok(OP["PING"])
        error_reply(c.call(OP["PEEK"], name("big") + struct.pack("<I", 0)), NOT_FOUND)
        # decided on the name and fixed fields: the record is dropped unchecked
        error_reply(c.call(OP["TABLE_INSERT"], name("none") + struct.pack("<dII", 1.0, 0, 0) +
                           big), NOT_FOUND)
        error_reply(c.call(OP["STREAM_APPEND"], name("none") + big), NOT_FOUND)
        c.ok(OP["PING"])


def test_waits_on_the_server(tensord):
    with Conn(tensord.port) as a, Conn(tensord.port) as b:
        # a table sample waits for min_size_to_sample items
        a.ok(OP["TABLE_CREATE"], name("t") + struct.pack("<QQdddIBBH", 8, 2, 1.0, 0.0, 0.0, 0,
                                                          0, 2, 0))
        rid = a.send(OP["TABLE_SAMPLE"], name("t") + struct.pack("<II", 1, 5000))
        assert a.waiting(rid)
        info = decode_record(b.ok(OP["TABLE_INFO"], name("t")))
        assert info["waiting_samples"] == 1 and info["can_sample"] == 0
        for v in (1, 2):
            b.ok(OP["TABLE_INSERT"], name("t") + struct.pack("<dII", 1.0, 0, 0) + int_record(v))
        rep = a.reply(rid)
        assert rep.status == OK and struct.unpack_from("<QII", rep.body) == (2, 1, 0)
        # a STREAM_CREDIT waits for an acknowledgement
        a.ok(OP["STREAM_CREATE"], name("s") + struct.pack("<QQIIII", 4, 0, 0, 1, 0, 0))
        a.ok(OP["STREAM_JOIN"], join_body("s", "g", "m"))
        a.ok(OP["STREAM_APPEND"], name("s") + int_record(1))
        rid = a.send(OP["STREAM_CREDIT"], name("s") + struct.pack("<I", 5000))
        assert a.waiting(rid)
        rd = name("s") + name("g") + name("m")
        entries(b.ok(OP["STREAM_READ"], rd + struct.pack("<QII", 0, 1, 0)))
        b.ok(OP["STREAM_ACK"], rd + struct.pack("<QQI", 1, 1, 0))
        rep = a.reply(rid)
        assert rep.status == OK and struct.unpack_from("<I", rep.body, 36)[0] == 1
        # a STREAM_READ waits for an append
        rid = a.send(OP["STREAM_READ"], rd + struct.pack("<QII", 0, 4, 5000))
        assert a.waiting(rid)
        b.ok(OP["STREAM_APPEND"], name("s") + int_record(2))
        _, last, _, got = entries(a.reply(rid).body)
        assert last == 2 and [h["id"] for h, _ in got] == [2]


def test_auth_challenge_twice_closes(tensord):
    with Conn(tensord.port, hello=False) as c:
        c.ok(OP["AUTH_CHALLENGE"], bytes(32))
        rid = c.send(OP["AUTH_CHALLENGE"], bytes(32))
        error_reply(c.reply(rid), BAD_REQUEST, OP["AUTH_CHALLENGE"], rid)
        assert c.closed_by_server()


def test_lz4_upload_rules(tensord):
    """Section 11 rule 4: an upload's raw_len is at least 1 and its block within LZ4's bound."""
    cases = [
        ("raw_len 0 upload", struct.pack("<Q", 0) + b"\x00"),
        ("block over the bound", struct.pack("<Q", 1) + lz4_literals(b"\x00") + bytes(17)),
    ]
    for what, body in cases:
        with Conn(tensord.port, hello_flags=0x01) as c:
            if c.hello_body[1] != 0x01:
                pytest.skip("this tensord was built without LZ4")
            rid = c.send(OP["PUT"], body, flags=1)
            error_reply(c.reply(rid), BAD_REQUEST, OP["PUT"], rid)
            assert c.closed_by_server(), what


# ---------------------------------------------------------------------------------------------
# Sharding (section 14)


def crc16_xmodem(data):
    crc = 0
    for b in data:
        crc ^= b << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def slot(n):
    n = n.encode() if isinstance(n, str) else n
    i = n.find(b"{")
    if i >= 0:
        j = n.find(b"}", i + 1)
        if j > i + 1:
            n = n[i + 1:j]
    return crc16_xmodem(n) % 16384


def test_slots_of_the_doc():
    assert crc16_xmodem(b"123456789") == 0x31C3
    assert slot("{exp7}.params") == slot("{exp7}.experience") == 6867
    assert slot("params") == 1749 and slot("{}params") == 3613 and slot("") == 0
    assert slot("{{a}}") == slot("{a")


def test_sharded_requests(start_tensord, tmp_path):
    path = tmp_path / "map"
    path.write_text("epoch 3\n10.0.0.1:8000\n10.0.0.2:8000\n")
    d = start_tensord("--cluster-map", str(path), "--shard", "1")
    theirs = "params"  # slot 1749: shard 0's
    mine = next("n%d" % i for i in range(1000) if slot("n%d" % i) >= 8192)
    with Conn(d.port) as c:
        def wrong(op, body):
            rep = c.call(OP[op], body)
            assert rep.status == WRONG_SHARD, (op, rep)
            sl, owner, alen, res, epoch = struct.unpack_from("<HHHHQ", rep.body)
            assert (sl, owner, alen, res, epoch) == (1749, 0, 13, 0, 3)
            assert rep.body[16:29] == b"10.0.0.1:8000"

        wrong("PUT", name(theirs) + int_record(1))
        wrong("PS_PULL", name(theirs) + struct.pack("<Q", 0))
        wrong("MGET", struct.pack("<II", 2, 0) + name(mine) + name(theirs))
        wrong("BARRIER", name(theirs) + struct.pack("<II", 1, 0))
        c.ok(OP["PUT"], name(mine) + int_record(1))
        # embedding tables are served whatever their name
        c.ok(OP["EMB_CREATE"], name(theirs) + EMB_OK)
        # sections 8.51 and 14.3: a sharded server checks a service's slot as it would a bin's
        wrong("SVC_REGISTER", name(theirs) + struct.pack("<II", 1, 0))
        wrong("SVC_CALL", name(theirs) + struct.pack("<II", 100, 0) + int_record(1))
        wrong("SVC_REPLY", name(theirs) + struct.pack("<QHHI", 1, 0, 0, 0) + int_record(1))
        c.ok(OP["SVC_REGISTER"], name(mine) + struct.pack("<II", 1, 0))
        stats = decode_record(c.ok(OP["STATS"]))
        assert (stats["shard"], stats["shards"], stats["map_epoch"]) == (1, 2, 3)


def test_get_that_leaves_items_and_rows_of_any_bin(tensord):
    """Sections 8.11 and 9: a GET that leaves items answers a WAIT; 8.20: READ_ROWS by key."""
    with Conn(tensord.port) as c:
        c.ok(OP["PUT"], name("g") + int_record(1))
        v2, _ = bin_state(c.ok(OP["APPEND"], name("g") + int_record(2)))
        rid = c.send(OP["WAIT"], name("g") + struct.pack("<QI", v2, 5000))
        ver, rem, recs = items(c.ok(OP["GET"], name("g") + struct.pack("<I", 1)))
        assert ver > v2 and rem == 1 and recs == [int_record(1)]
        assert bin_state(c.reply(rid).body) == (ver, 1)
        t = tensor_of(5, (3, 2), list(range(6)))
        c.ok(OP["APPEND"], name("g") + encode_record({"x": t}))
        body = c.ok(0x13, name("g") + struct.pack("<iH", -1, 1) + b"x" + struct.pack("<QQ", 1, 3))
        v, rem, recs = items(body)
        assert rem == 2 and recs == [encode_record(Tensor(5, (2, 2), t.data[8:]))]
        error_reply(c.call(0x13, name("g") + struct.pack("<iH", 0, 0) + struct.pack("<QQ", 0, 1)),
                    INVALID)
        error_reply(c.call(0x13, name("g") + struct.pack("<iH", -1, 1) + b"x" +
                           struct.pack("<QQ", 2, 5)), INVALID)
        error_reply(c.call(0x13, name("g") + struct.pack("<iH", -1, 1) + b"y" +
                           struct.pack("<QQ", 0, 1)), NOT_FOUND)


def unix_conn(path, flags):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(IO_TIMEOUT_S)
    s.connect(path)
    s.sendall(frame(OP["HELLO"], struct.pack("<BBH", 1, flags, 0), rid=1))
    rep, _ = recv_frame_with_fds(s)
    assert rep.status == OK
    return s, rep.body[1]


def send_with_fds(sock, data, fds):
    sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


def test_descriptor_rules(tensord):
    """Sections 8.17 and 13: descriptors on the unix socket."""
    if not hasattr(os, "memfd_create"):
        pytest.skip("no memfd_create")
    r, w = os.pipe()
    fds = [r, w]
    try:
        # without FDS, descriptors are closed at once and never counted
        s, granted = unix_conn(tensord.unix_path, 0)
        with s:
            assert granted == 0
            send_with_fds(s, frame(OP["PING"], rid=2), [r] * 17)
            rep, got = recv_frame_with_fds(s)
            assert (rep.rid, rep.status, got) == (2, OK, [])
        # with FDS: a pipe is not a sealable memfd (INVALID, the connection stays)
        s, granted = unix_conn(tensord.unix_path, 0x02)
        with s:
            assert granted == 0x02
            send_with_fds(s, frame(0x10, name("x") + struct.pack("<Q", 64), rid=2), [r])
            rep, _ = recv_frame_with_fds(s)
            assert (rep.rid, rep.status) == (2, INVALID), rep
            # a memfd still mapped writable is refused too
            m = os.memfd_create("w", os.MFD_ALLOW_SEALING)
            fds.append(m)
            os.write(m, int_record(1))
            with mmap.mmap(m, 64, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE):
                send_with_fds(s, frame(0x10, name("x") + struct.pack("<Q", 64), rid=3), [m])
                rep, _ = recv_frame_with_fds(s)
                assert (rep.rid, rep.status) == (3, INVALID), rep
            send_with_fds(s, frame(0x10, name("x") + struct.pack("<Q", 64), rid=4), [m])
            rep, _ = recv_frame_with_fds(s)
            assert (rep.rid, rep.status) == (4, OK), rep
            # a PUT_FD without a descriptor: BAD_REQUEST, closed
            s.sendall(frame(0x10, name("x") + struct.pack("<Q", 64), rid=5))
            rep, _ = recv_frame_with_fds(s)
            assert (rep.rid, rep.status) == (5, BAD_REQUEST), rep
        # more than 16 descriptors not claimed: BAD_REQUEST with opcode 0, closed
        s, _ = unix_conn(tensord.unix_path, 0x02)
        with s:
            send_with_fds(s, frame(OP["PING"], rid=2), [r] * 17)
            frames = []
            for _ in range(3):
                try:
                    rep, _ = recv_frame_with_fds(s)
                except Closed:
                    break
                frames.append((rep.opcode, rep.rid, rep.status))
            assert (0, 0, BAD_REQUEST) in frames, frames
    finally:
        for f in fds:
            os.close(f)


def test_slow_reader(start_tensord):
    """Sections 5, 7 and 13: a client that does not read its replies is cut off with
    SLOW_READER (opcode 0, request id 0) once its queued output passes --max-output."""
    d = start_tensord("--max-output", "1048576")
    with Conn(d.port) as c:
        c.ok(OP["PUT"], name("big") + encode_record(Blob(bytes(512 << 10))))
        c.sock.sendall(b"".join(frame(OP["PEEK"], name("big") + struct.pack("<I", 0), rid=10 + i)
                                for i in range(64)))
        time.sleep(0.5)
        frames = []
        for _ in range(80):
            try:
                f = c.read_frame()
            except Closed:
                break
            frames.append((f.opcode, f.rid, f.status))
        assert frames and frames[-1] == (0, 0, 14), frames[-3:]
        assert all(st == OK for _, _, st in frames[:-1])
