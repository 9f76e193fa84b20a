#!/usr/bin/env python3
"""Writes the hand-made seed inputs of every target to corpus/<target>/seed-*.

Run from fuzz/: `python3 seeds/make_seeds.py`. Seeds are named by content hash, so rerunning
is idempotent and never duplicates what `cargo fuzz cmin` keeps.
"""
import hashlib
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "corpus")


def put(target, data):
    if isinstance(data, str):
        data = data.encode()
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    name = "seed-" + hashlib.sha1(data).hexdigest()[:16]
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# --- http1_guard: [limits, seed] + client bytes ------------------------------------------
HTTP = [
    "GET / HTTP/1.1\r\nHost: example.com\r\n\r\n",
    "GET /a?b=c HTTP/1.1\r\nHost: svc.ns.svc.cluster.local:8080\r\nbaggage: sd-routing-key=dev1\r\n\r\n"
    "GET /second HTTP/1.1\r\nHost: svc\r\n\r\n",
    "POST /upload HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello"
    "GET /next HTTP/1.1\r\nHost: a\r\n\r\n",
    "POST /c HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    "5;ext=1\r\nhello\r\n0\r\nx-trailer: t\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",
    # Bare LFs: head, chunk size line, after chunk data, trailers.
    "GET / HTTP/1.1\nHost: a\n\n",
    "GET / HTTP/1.1\r\nHost: a\nX: y\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\nhello\r\n0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\n0\r\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\nt: 1\n\r\n",
    "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
    "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "\r\n\r\nGET / HTTP/1.0\r\n\r\n",
    "CONNECT db.ns.svc:5432 HTTP/1.1\r\nHost: db.ns.svc:5432\r\n\r\n\n\n",
    "GET /ws HTTP/1.1\r\nHost: a\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n\x81\x05hello\n",
    "GET http://a.example/x HTTP/1.1\r\nHost: a.example\r\n\r\n",
    "GET http://a.example/x HTTP/1.1\r\nHost: b.example\r\n\r\n",
    "GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    "GET / HTTP/1.1\r\nHost: [::1]:8080\r\n\r\n",
    "GET / HTTP/1.1\r\nHost: user@a\r\n\r\n",
    "OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n",
    "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00",
    "\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + "\x00" * 32,
    "*1\r\n$4\r\nPING\r\n",
    "get / HTTP/1.1\r\n\r\n",
    "G@T / HTTP/1.1\r\n\r\n",
]
for i, h in enumerate(HTTP):
    put("http1_guard", bytes([[4, 0, 1, 2, 3][i % 5] | ((i * 8) & 0xF8), i * 37 & 0xFF]) + h.encode("latin-1"))

# --- rule_files: rule documents -----------------------------------------------------------
RULE = {
    "routingKey": "dev1",
    "baseline": {"kind": "Deployment", "namespace": "demo", "name": "web"},
    "destinationSandbox": {"name": "sb1"},
    "mappings": [{"workloadPort": 8080, "destinations": [{"host": "10.0.0.7", "port": 9180}]}],
}
put("rule_files", """\
- routingKey: dev1
  baseline: {kind: Deployment, namespace: demo, name: web}
  destinationSandbox: {name: sb1}
  mappings:
    - workloadPort: 8080
      destinations: [{host: 127.0.0.1, port: 9180}]
""")
put("rule_files", """\
# Two keys, two ports, an IPv6 and a DNS destination.
- routingKey: ltj9s8scupb86
  baseline:
    kind: ArgoRollout
    namespace: shop
    name: cart.v2
  destinationSandbox:
    name: feature-x
  mappings:
    - workloadPort: 80
      destinations:
        - host: "::1"
          port: 8080
    - workloadPort: 9090
      destinations:
        - host: cart-feature-x.shop.svc.cluster.local
          port: 9090
        - host: 10.1.2.3
          port: 9090
- routingKey: a.b_c-d
  baseline: {kind: Deployment, namespace: shop, name: cart.v2}
  destinationSandbox: {name: other}
  mappings: []
""")
put("rule_files", json.dumps({"routingRules": [RULE]}))
put("rule_files", json.dumps([RULE, dict(RULE, routingKey="dev2")], indent=2))
put("rule_files", json.dumps([RULE, RULE]))  # duplicate (baseline, key)
put("rule_files", json.dumps([dict(RULE, mappings=[{"workloadPort": 70000, "destinations": []}])]))
put("rule_files", "")
put("rule_files", "routingRules: []\n")
put("rule_files", "- routingKey: [\n")
put("rule_files", "--- \n- &r {routingKey: k, baseline: {kind: D, namespace: n, name: w}, "
    "destinationSandbox: {name: s}, mappings: []}\n- *r\n")

# --- routes_proto: protobuf ---------------------------------------------------------------
def varint(n):
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def field_bytes(tag, data):
    return varint(tag << 3 | 2) + varint(len(data)) + data


def field_varint(tag, n):
    return varint(tag << 3) + varint(n)


def s(tag, text):
    return field_bytes(tag, text.encode())


def rule(key="dev1", kind="Deployment", ns="demo", name="web", sb="sb1", maps=((8080, (("10.0.0.7", 9180),)),)):
    out = s(1, key)
    out += field_bytes(2, s(1, kind) + s(2, ns) + s(3, name))
    out += field_bytes(3, s(1, sb))
    for port, dests in maps:
        m = field_varint(1, port)
        for host, p in dests:
            m += field_bytes(2, s(1, host) + field_varint(2, p))
        out += field_bytes(4, m)
    return out


def op(kind, r=None):
    body = field_varint(1, kind) if kind else b""
    if r is not None:
        body += field_bytes(2, r)
    return varint(len(body)) + body


put("routes_proto", field_bytes(1, rule()) + field_bytes(1, rule(key="dev2", maps=((80, (("::1", 8080), ("a.b", 81))), (443, (("c", 8443),))))))
put("routes_proto", field_bytes(1, rule()) + field_bytes(1, rule()))
put("routes_proto", op(0, rule()) + op(0, rule(key="dev2")) + op(3) + op(2, rule(maps=((8080, (("10.0.0.8", 9180),)),))) + op(1, rule(key="dev2")))
put("routes_proto", op(0, rule(ns="other")) + op(0, rule(key="k", sb="")) + op(7, rule()))
put("routes_proto", rule(maps=((0, ()), (70000, (("h", 1),)))))
put("routes_proto", b"")

# --- tunnel_frames: [limits/splits] + length-prefixed JSON frames -------------------------
def frame(obj):
    data = json.dumps(obj, separators=(",", ":")).encode() if not isinstance(obj, bytes) else obj
    return struct.pack(">I", len(data)) + data


FRAMES = [
    [{"type": "hello", "version": 1, "client_name": "alice-laptop", "token": "s3cr3t"},
     {"type": "bind", "id": "web-8080", "meta": "{\"port\":8080}"},
     {"type": "ping", "seq": 7}, {"type": "unbind", "id": "web-8080"},
     {"type": "goaway", "reason": "bye"}, {"type": "drained"}],
    [{"type": "welcome", "version": 1, "session_id": 42, "identity": "user:alice"},
     {"type": "bind_ack", "id": "web-8080"}, {"type": "bind_ack", "id": "x", "error": "taken"},
     {"type": "open_reverse", "open_id": 3, "bind": "web-8080"},
     {"type": "refused", "code": "unauthenticated", "reason": "no token", "retry": False},
     {"type": "future_thing", "x": 1}],
    [{"kind": "connect", "host": "db.ns.svc.cluster.local", "port": 5432}, {"result": "ok"}],
    [{"kind": "connect", "host": "[::1]", "port": 0}, {"result": "error", "reason": "refused"}],
    [{"kind": "reverse", "bind": "web-8080", "open_id": 9}, {"kind": "reverse", "bind": "bad id"}],
    [{"type": "hello", "version": 1, "client_name": "tab\there"}, {"type": "bind", "id": "", "meta": ""}],
]
for i, frames in enumerate(FRAMES):
    put("tunnel_frames", bytes([(i * 9) & 0xFF]) + b"".join(frame(f) for f in frames))
put("tunnel_frames", bytes([1]) + struct.pack(">I", 0xFFFFFFFF) + b"{}")
put("tunnel_frames", bytes([2]) + frame(b"{\"type\":\"ping\",\"seq\":1}")[:-3])

# --- socks_connect: client bytes ----------------------------------------------------------
put("socks_connect", bytes([5, 1, 0, 5, 1, 0, 1, 10, 0, 0, 7, 0x1F, 0x90]) + b"GET / HTTP/1.1\r\n\r\n")
put("socks_connect", bytes([5, 2, 0, 2, 1, 4]) + b"user" + bytes([4]) + b"pass" + bytes([5, 1, 0, 3, 20]) + b"db.ns.svc.cluster.lo" + bytes([0x15, 0x38]))
put("socks_connect", bytes([5, 1, 2, 1, 4]) + b"user" + bytes([4]) + b"pass" + bytes([5, 1, 0, 4]) + bytes(15) + bytes([1, 0, 80]))
put("socks_connect", bytes([5, 1, 0, 5, 2, 0, 1, 127, 0, 0, 1, 0, 1]))  # BIND: refused
put("socks_connect", bytes([5, 1, 0, 5, 1, 0, 3, 3]) + b"a/b" + bytes([0, 80]))
put("socks_connect", bytes([5, 1, 0, 5, 1, 0, 1, 127, 0, 0, 1, 0, 1]))  # port 1: dial refused
put("socks_connect", "CONNECT db.ns.svc:5432 HTTP/1.1\r\nHost: db.ns.svc:5432\r\n\r\nhello")
put("socks_connect", "CONNECT [::1]:443 HTTP/1.1\r\n\r\n")
put("socks_connect", "CONNECT 10.0.0.1:1 HTTP/1.1\r\n\r\n")
put("socks_connect", "GET http://a/ HTTP/1.1\r\nHost: a\r\n\r\n")
put("socks_connect", "CONNECT a@b:80 HTTP/1.1\r\n\r\n")

# --- admission_review: AdmissionReview JSON -----------------------------------------------
def review(pod, op="CREATE", ns="shop"):
    return json.dumps({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": ns, "operation": op,
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": pod, "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }, indent=1)


def pod(annotations=None, labels=None, owner=True, containers=None, init=None, **spec):
    p = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": "web-7d9f8b-", "labels": labels or {"app": "web"},
                     "annotations": annotations or {"sidecar.spur.dev/inject": "true"}},
        "spec": dict({"containers": containers or [
            {"name": "web", "image": "nginx:1.27", "ports": [{"containerPort": 8080}]}]}, **spec),
    }
    if owner:
        p["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                             "name": "web-7d9f8b", "uid": "u1", "controller": True}]
    if init is not None:
        p["spec"]["initContainers"] = init
    return p


put("admission_review", review(pod()))
put("admission_review", review(pod(annotations={
    "sidecar.spur.dev/inject": "true", "sidecar.spur.dev/interception": "initContainer",
    "sidecar.spur.dev/placement": "native", "sidecar.spur.dev/exclude-inbound-ports": "9090, 15090",
    "sidecar.spur.dev/inbound-ports": "8080"}, init=[{"name": "migrate", "image": "m"}],
    volumes=[{"name": "data", "emptyDir": {}}], serviceAccountName="web")))
put("admission_review", review(pod(annotations={"sidecar.spur.dev/inject": "true",
                                                "sidecar.spur.dev/exclude-inbound-ports": "80,x"})))
put("admission_review", review(pod(annotations={"sidecar.spur.dev/inject": "true",
                                                "sidecar.spur.dev/placement": "sideways"})))
put("admission_review", review(pod(hostNetwork=True)))
put("admission_review", review(pod(labels={"spur.dev/fork": "x"})))
put("admission_review", review(pod(owner=False)))
put("admission_review", review(pod(annotations={"sidecar.spur.dev/inject": "false"})))
put("admission_review", review(pod(containers=[{"name": "spur-sidecar", "image": "s"}])))
put("admission_review", review(pod(), ns="kube-system"))
put("admission_review", review(pod(annotations={"a/b~c": "~1"}), op="UPDATE"))
put("admission_review", json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}))

# --- baggage: header lines ------------------------------------------------------------------
put("baggage", "sd-routing-key=dev1,userId=alice;prop=1,serverNode=DF%2028\n"
    "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7\n")
put("baggage", "k=%E2%9C%93, k2 = v2 ;p;q=r\nvendor@tenant=x,a=b\n\n,,,=,k=\n")
put("baggage", "\n".join(f"k{i}=v{i}" for i in range(200)))

# --- extract: query line, then <n><value> header lines -------------------------------------
put("extract", "sd-routing-key=dev1&x=1\n\x00sd-routing-key=dev2,other=1\n\x01sd=abc\n\x02dev3\n\x04dev4\n")
put("extract", "a=1&sd-routing-key=&sd-routing-key=k%2E1&b\n\x00bad key=1\n\x05x\n\x06ltj9s8scupb86\n")
put("extract", "\n\x02" + "k" * 70 + "\n\x02a.b_c-d\n")

# --- lookup: 4 bytes per rule up to 0xff, then 3 bytes per probe ---------------------------
put("lookup", bytes([0, 0, 0b1111, 1, 1, 0, 0b0011, 2, 0, 1, 0b0100, 3, 0xFF, 0, 0, 1, 1, 0, 2, 5, 1, 3, 0, 1, 4]))
put("lookup", bytes([3, 2, 0b1000, 9, 3, 2, 0b0001, 9, 0xFF, 3, 2, 4, 3, 2, 1]))

# --- rest_api: request target line, header lines, blank line, body ------------------------
for target in [
    "/api/v1/workloads/routing-rules",
    "/api/v1/workloads/routing-rules?baselineKind=Deployment&baselineNamespace=shop&baselineName=api",
    "/api/v1/workloads/routes?routingKey=k1&destinationSandboxName=sb1",
    "/api/v1/workloads/routing-rules?baselineKind=%ZZ&&=&routingKey=%00&routingKey=k2&x",
    "/api/v1/workloads/routing-rules/watch?routingKey=k2",
    "/healthz",
    "/metrics",
    "http://routeserver/api/v1/workloads/routing-rules?baselineName=web",
    "*",
    "/api/v1/workloads/routing-rules?" + "&".join(f"baselineName={i}" for i in range(100)),
]:
    put("rest_api", target + "\n")
put("rest_api", "/api/v1/workloads/routing-rules\nAuthorization: Bearer abc\nAccept: */*\n\n")
put("rest_api", "/api/v1/workloads/routing-rules\nHost: other\n\n")
put("rest_api", "/healthz\nTransfer-Encoding: chunked\n\n0\r\n\r\n")
put("rest_api", "/api/v1/workloads/routing-rules/watch\nConnection: upgrade\nUpgrade: h2c\n\n")

# --- kafka_batches: [flags] + v2 record batches (bit 0 of flags: the target fixes the CRCs) ----
def zz(n, bits=64):
    return varint((n << 1) ^ (n >> (bits - 1)))


def kbytes(b):
    return zz(-1) if b is None else zz(len(b)) + b


def krecord(delta, key=None, value=b"v", headers=()):
    body = b"\x00" + zz(delta * 10) + zz(delta) + kbytes(key) + kbytes(value) + zz(len(headers))
    for k, v in headers:
        body += kbytes(k) + kbytes(v)
    return zz(len(body)) + body


def kbatch(base, records, codec=0, attrs=0, last_delta=None):
    payload = b"".join(records)
    if codec == 1:
        import gzip
        payload = gzip.compress(payload, mtime=0)
    last = len(records) - 1 if last_delta is None else last_delta
    rest = struct.pack(">hiqqqhii", codec | attrs, last, 1700000000000, 1700000000100, 42, 1, 0, len(records))
    rest += payload
    # baseOffset, batchLength, partitionLeaderEpoch, magic, crc (fixed by the target)
    return struct.pack(">qiibI", base, 4 + 1 + 4 + len(rest), 0, 2, 0) + rest


BAG = (b"baggage", b"sd-routing-key=sbx1")
recs = [krecord(i, b"k%d" % i, b"value %d" % i, [BAG] if i % 3 == 0 else [(b"traceparent", b"00-1-2-01")]) for i in range(6)]
put("kafka_batches", bytes([1]) + kbatch(0, recs) + kbatch(6, recs, codec=1))
put("kafka_batches", bytes([0b101]) + kbatch(100, recs[:2], last_delta=9) + kbatch(110, []))
put("kafka_batches", bytes([3]) + kbatch(0, [krecord(0, None, None, [BAG, BAG, (b"Baggage", None)])], attrs=0x10)
      + kbatch(1, [krecord(0, b"\x00\x00\x00\x01", b"\x00\x00\x00\x00\x00\x05")], attrs=0x30))
put("kafka_batches", bytes([1]) + kbatch(0, recs) + kbatch(6, recs)[:40])
