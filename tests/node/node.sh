#!/usr/bin/env bash
# The node tier's cluster: a real one-node Kubernetes cluster (etcd, kube-apiserver with RBAC,
# kube-controller-manager, kube-scheduler, kubelet, kube-proxy, CoreDNS, containerd + runc + CNI
# bridge) run as this script's own processes inside a network namespace it creates, with no route
# out of it. Facts behind every setting: ../shared/research/real-node.md (and tests/node/README.md).
#
# Usage:
#   tests/node/node.sh up [IMAGE_TAR...]   start a node, import the OCI archives, wait until the node
#                                          is Ready; the last stdout line is the node's env file
#                                          (SPUR_NODE_* variables, see below)
#   tests/node/node.sh down ROOT           stop everything of the node under ROOT and remove it
#   tests/node/node.sh cleanup             stop and remove every node left behind by earlier runs
#                                          (a node whose owner process, SPUR_NODE_OWNER or else
#                                          the caller of `up`, is gone)
#   tests/node/node.sh restart-containerd ROOT
#                                          stop the node's containerd (SIGTERM; its shims and so
#                                          the pods' containers live on) and start it again, as a
#                                          node's runtime upgrade does; returns once it answers
#
# The env file sets SPUR_NODE_ROOT, SPUR_NODE_NETNS, SPUR_NODE_IP, SPUR_NODE_KUBECONFIG (admin,
# reachable from the host over the node's veth), SPUR_NODE_CONTAINERD (the CRI socket),
# SPUR_NODE_BINDIR and SPUR_NODE_CGROUP (the pods' cgroups are <hierarchy>/<it>/kubepods/...).
# Needs root, the binaries of tests/kube/build.sh (SPUR_KUBE_BINDIR), and
# containerd, runc, containernetworking-plugins, iptables, iproute2 and openssl (tests/run.sh
# installs them).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

# Every node lives under this prefix, so `cleanup` finds what a killed run left behind.
PREFIX="${SPUR_NODE_PREFIX:-/var/tmp/spur-node-}"
NODE_NAME=spur-node
# The node's veth: 172.30.<k>.2 inside, 172.30.<k>.1 on the host, k the first free /30 (two nodes,
# a developer's and a test run's, can run side by side).
HOST_IP=
NODE_IP=
POD_CIDR=10.244.0.0/24
CLUSTER_CIDR=10.244.0.0/16
SERVICE_CIDR=10.96.0.0/16
API_SERVICE_IP=10.96.0.1
CNI_BIN="${SPUR_NODE_CNI_BIN:-/usr/lib/cni}"
# The kubelet sets these global (not per-namespace) sysctls; `down` puts the old values back.
SYSCTLS=(vm.overcommit_memory kernel.panic kernel.panic_on_oops)
CGROUP_FS=/sys/fs/cgroup

log() { echo "tests/node/node.sh: $*" >&2; }
die() { log "$*"; exit 1; }

# One lock for every node of the machine: `up` holds it from the clean-up of leftovers until its
# root, owner and addresses are in place, `down` while it takes a node apart.
LOCK="${PREFIX%-}.lock"
LOCKED=
lock() {
    [ -z "$LOCKED" ] || return 0
    exec 8>>"$LOCK"
    flock 8
    LOCKED=1
}
unlock() {
    [ -n "$LOCKED" ] || return 0
    flock -u 8
    LOCKED=
}

# "pid start-time" of a process (start time in clock ticks since boot, field 22 of
# /proc/<pid>/stat), so a pid reused by another process is not taken for the owner.
process_id() {
    local pid="$1" stat
    stat="$(cat "/proc/$pid/stat" 2>/dev/null)" || return 1
    stat="${stat##*) }"
    # After "pid (comm) ", the fields start at 3 (state): start time (22) is the 20th of them.
    # shellcheck disable=SC2086 # split on purpose
    set -- $stat
    # A zombie has ended (here nobody may reap an orphan for a while).
    [ "$1" != Z ] || return 1
    echo "$pid ${20}"
}

# Whether the owner recorded in ROOT/owner ("pid start-time") still runs.
owner_alive() {
    local pid start now
    read -r pid start 2>/dev/null <"$1/owner" || return 1
    [ -n "$pid" ] || return 1
    now="$(process_id "$pid" | cut -d' ' -f2)" || return 1
    [ "$now" = "$start" ]
}

# Whether a node other than ROOT runs (its owner is alive).
other_node_alive() {
    local other
    for other in "$PREFIX"*; do
        [ "$other" != "$1" ] && [ -d "$other" ] && owner_alive "$other" && return 0
    done
    return 1
}

# ---------------------------------------------------------------------------------------------
# down: everything `up` started or changed, in an order that never leaves a process holding a
# mount or a cgroup. Idempotent, best effort (one failed step does not stop the others), and
# works on a half-started node.
# ---------------------------------------------------------------------------------------------
down() {
    local -
    set +e +o pipefail
    local root="$1" id ns started=$SECONDS
    id="${root#"$PREFIX"}"
    # Only a node's root: PREFIX and a six-digit hex id, never a path given by mistake.
    if [ "$root" = "$id" ] || ! [[ "$id" =~ ^[0-9a-f]{6}$ ]]; then
        log "not a node root: $root"
        return 1
    fi
    [ -d "$root" ] || return 0
    lock
    ns="spur-node-$id"
    # The laptops of the tunnel tests (tests/src/node.rs): their processes, then the namespaces.
    local lap
    for lap in $(ip netns list 2>/dev/null | awk -v p="spur-laptop-$id-" 'index($1, p) == 1 { print $1 }'); do
        ip netns pids "$lap" 2>/dev/null | xargs -r kill -KILL 2>/dev/null
        ip netns del "$lap" 2>/dev/null
    done
    # Control plane and node agents first, so nothing restarts the pods killed below.
    stop_pids "$root" kubelet kube-proxy coredns kube-scheduler kube-controller-manager
    # The pods' processes: everything in the node's cgroup subtree, then the shims of this
    # node's containerd (they outlive containerd by design).
    kill_cgroup_tree "$(cgroup_root "$id")"
    local pid
    for pid in $(pgrep -f "containerd-shim.*-address $root/"); do
        kill -KILL "$pid" 2>/dev/null
    done
    stop_pids "$root" containerd kube-apiserver
    stop_pids "$root" etcd
    # Whatever of the node still runs without a pid file (a teardown cut short before): every
    # process but this one whose command line names the root.
    for pid in $(pgrep -f -- "$root/"); do
        [ "$pid" = "$$" ] || kill -KILL "$pid" 2>/dev/null
    done
    # Mounts below the root (pod volumes, rootfs, the pods' network namespaces), deepest first.
    local mnt
    while read -r mnt; do
        umount -l "$mnt" 2>/dev/null
    done < <(mounts_under "$root")
    remove_cgroup_tree "$(cgroup_root "$id")"
    ip netns del "$ns" 2>/dev/null
    ip link del "spn$id" 2>/dev/null
    if [ -f "$root/sysctls" ]; then
        local key value
        while read -r key value; do
            sysctl -q -w "$key=$value" >/dev/null 2>&1 || log "could not restore $key=$value"
        done <"$root/sysctls"
    fi
    # What the kubelet, containerd and libcni write at fixed paths outside the node's root.
    find /var/log/containers -maxdepth 1 -type l -lname "$root/*" -delete 2>/dev/null
    rm -f /var/lib/cni/results/"$ns"-* 2>/dev/null
    if ! other_node_alive "$root"; then
        # libcni's cache: a file per pod network attach (also containerd's own cni-loopback),
        # never removed when the pod goes, and naming no node: with no other node running, every
        # entry made since this one started is this node's.
        [ -f "$root/owner" ] && find /var/lib/cni/results -maxdepth 1 -type f -newer "$root/owner" -delete 2>/dev/null
        if [ -f "$root/created" ]; then
            # Directories this node created: the sockets in them are its own (the kubelet's device
            # plugin socket, containerd's shim sockets), and they go once they are empty.
            local path
            while read -r path; do
                [ -d "$path" ] || continue
                find "$path" -type s -delete 2>/dev/null
                find "$path" -depth -type d -empty -delete 2>/dev/null
            done <"$root/created"
        fi
    fi
    # Never delete through a mount that did not go (a bind mount of a host directory).
    if [ -n "$(mounts_under "$root")" ]; then
        log "mounts are left under $root; not removing it: $(mounts_under "$root" | tr '\n' ' ')"
        return 1
    fi
    rm -rf "$root"
    log "node $root removed in $((SECONDS - started)) s"
}

mounts_under() {
    awk -v r="$1/" 'index($5, r) == 1 { print length($5) " " $5 }' /proc/self/mountinfo | sort -rn | cut -d' ' -f2-
}

# Stops the named processes of the node together: TERM, up to 5 s to exit, then KILL. Only a
# process whose command line names the node's root: a pid file outliving its process (a reboot)
# must not kill whoever has that pid now.
stop_pids() {
    local root="$1" name pid pids=() i alive
    shift
    for name in "$@"; do
        [ -f "$root/pids/$name" ] || continue
        pid="$(cat "$root/pids/$name" 2>/dev/null)"
        rm -f "$root/pids/$name"
        [ -n "$pid" ] && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "$root/" || continue
        kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
    done
    [ ${#pids[@]} -gt 0 ] || return 0
    for i in $(seq 50); do
        alive=
        for pid in "${pids[@]}"; do
            kill -0 "$pid" 2>/dev/null && alive=1
        done
        [ -n "$alive" ] || return 0
        sleep 0.1
    done
    for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null; done
}

cgroup_root() { echo "spur-node-$1"; }

kill_cgroup_tree() {
    local rel="$1" procs pid round
    for round in 1 2 3; do
        procs="$(find "$CGROUP_FS"/*/"$rel" -name cgroup.procs 2>/dev/null | xargs -r cat 2>/dev/null | sort -u)"
        [ -n "$procs" ] || return 0
        for pid in $procs; do kill -KILL "$pid" 2>/dev/null; done
        sleep 0.3
    done
}

remove_cgroup_tree() {
    local rel="$1" dir
    for dir in "$CGROUP_FS"/*/"$rel"; do
        [ -d "$dir" ] || continue
        find "$dir" -depth -type d -exec rmdir {} \; 2>/dev/null
    done
}

# Removes the nodes whose owner process is gone (a killed run's), and namespaces without a node.
cleanup() {
    local root
    lock
    for root in "$PREFIX"*; do
        [ -d "$root" ] || continue
        owner_alive "$root" && continue
        log "removing a node left behind: $root"
        down "$root" || true
    done
    local ns
    for ns in $(ip netns list 2>/dev/null | awk '$1 ~ /^spur-(node|laptop)-/ { print $1 }'); do
        local id="${ns#spur-node-}"
        id="${id#spur-laptop-}"
        id="${id%%-*}"
        [ -d "$PREFIX$id" ] && continue
        ip netns pids "$ns" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true
    done
}

# ---------------------------------------------------------------------------------------------
# up
# ---------------------------------------------------------------------------------------------
# Starts a process of the node inside its network namespace (only the network: the mount
# namespace stays the host's, because the kubelet's volume mounts must be seen by containerd),
# in its own session, logging to $ROOT/logs/<name>.log.
start() {
    local name="$1"
    shift
    nsenter --net="/run/netns/$NS" setsid "$@" >"$ROOT/logs/$name.log" 2>&1 </dev/null &
    echo $! >"$ROOT/pids/$name"
}

wait_for() {
    local what="$1" tries="$2" name="$3"
    shift 3
    local i
    for i in $(seq "$tries"); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        if [ -n "$name" ] && ! kill -0 "$(cat "$ROOT/pids/$name")" 2>/dev/null; then
            log "$name exited while waiting for $what; the end of its log ($ROOT/logs/$name.log):"
            tail -n 30 "$ROOT/logs/$name.log" >&2 || true
            return 1
        fi
        sleep 0.5
    done
    log "timed out waiting for $what"
    [ -z "$name" ] || tail -n 30 "$ROOT/logs/$name.log" >&2 || true
    return 1
}

in_ns() { nsenter --net="/run/netns/$NS" "$@"; }

kubectl_admin() { "$BINDIR/kubectl" --kubeconfig "$ROOT/admin.kubeconfig" --cache-dir "$ROOT/kubectl-cache" "$@"; }

pki() {
    local d="$ROOT/pki"
    mkdir -p "$d"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
        -subj "/CN=spur-node-ca" -keyout "$d/ca.key" -out "$d/ca.crt" 2>/dev/null
    # name, subject, SANs (empty: a client certificate)
    issue() {
        local name="$1" subj="$2" san="$3" ext
        openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "$subj" \
            -keyout "$d/$name.key" -out "$d/$name.csr" 2>/dev/null
        if [ -n "$san" ]; then
            ext="subjectAltName=$san
extendedKeyUsage=serverAuth,clientAuth"
        else
            ext="extendedKeyUsage=clientAuth"
        fi
        openssl x509 -req -in "$d/$name.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial \
            -days 2 -out "$d/$name.crt" -extfile <(echo "$ext") 2>/dev/null
    }
    issue apiserver "/CN=kube-apiserver" \
        "IP:$NODE_IP,IP:$API_SERVICE_IP,IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
    issue apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" ""
    issue kubelet "/CN=$NODE_NAME" "IP:$NODE_IP,DNS:$NODE_NAME"
    # The front proxy (aggregated APIs, e.g. jobs.spur.dev): its own CA, as kubeadm makes it,
    # and the client certificate the apiserver presents to aggregated API servers.
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
        -subj "/CN=spur-node-front-proxy-ca" -keyout "$d/front-proxy-ca.key" \
        -out "$d/front-proxy-ca.crt" 2>/dev/null
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
        -subj "/CN=front-proxy-client" -keyout "$d/front-proxy-client.key" \
        -out "$d/front-proxy-client.csr" 2>/dev/null
    openssl x509 -req -in "$d/front-proxy-client.csr" -CA "$d/front-proxy-ca.crt" \
        -CAkey "$d/front-proxy-ca.key" -CAcreateserial -days 2 -out "$d/front-proxy-client.crt" \
        -extfile <(echo "extendedKeyUsage=clientAuth") 2>/dev/null
    openssl ecparam -name prime256v1 -genkey -noout -out "$d/sa.key" 2>/dev/null
    openssl ec -in "$d/sa.key" -pubout -out "$d/sa.pub" 2>/dev/null
}

kubeconfig() {
    local file="$1" user="$2" token="$3"
    cat >"$file" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: spur-node
  cluster:
    server: https://$NODE_IP:6443
    certificate-authority: $ROOT/pki/ca.crt
users:
- name: $user
  user:
    token: $token
contexts:
- name: spur-node
  context: {cluster: spur-node, user: $user}
current-context: spur-node
EOF
    chmod 600 "$file"
}

up() {
    [ "$(id -u)" -eq 0 ] || die "needs root (network namespaces, containerd, the kubelet)"
    BINDIR="${SPUR_KUBE_BINDIR:-$("$here/../kube/build.sh" | tail -n 1)}"
    local bin
    for bin in etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl coredns; do
        [ -x "$BINDIR/$bin" ] || die "$BINDIR/$bin is missing: run tests/kube/build.sh"
    done
    for bin in containerd containerd-shim-runc-v2 runc ctr iptables ip openssl nsenter pgrep sysctl flock; do
        command -v "$bin" >/dev/null || die "'$bin' is not installed (tests/run.sh installs what the node needs)"
    done
    [ -x "$CNI_BIN/bridge" ] || die "no CNI plugins in $CNI_BIN (Debian: containernetworking-plugins)"

    # Held until this node's root, owner and addresses are in place (see `lock`).
    lock
    cleanup
    local id
    id="$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')"
    ROOT="$PREFIX$id"
    NS="spur-node-$id"
    mkdir -p "$ROOT"/{logs,pids,etcd,containerd/root,containerd/state,cni/net.d,cni/ipam,kubelet,pod-logs,volume-plugins,kubectl-cache,runc,opt}
    chmod 700 "$ROOT"
    # The process whose life the node's follows: `cleanup` leaves a node alone while it lives.
    # Callers that start the node from a command substitution must name themselves
    # (SPUR_NODE_OWNER=$$): the parent of this script is then a subshell that ends at once.
    local owner="${SPUR_NODE_OWNER:-$PPID}"
    process_id "$owner" >"$ROOT/owner" || die "the owner process $owner does not run"
    # From here on a failure takes the half-started node down with it.
    trap 'rc=$?; if [ $rc -ne 0 ]; then log "start-up failed; logs were in $ROOT/logs"; down "$ROOT"; fi' EXIT
    local started=$SECONDS

    # The host's own values: from a node that runs already (its kubelet changed them since), or
    # as they are now.
    local key other saved=
    for other in "$PREFIX"*; do
        if [ "$other" != "$ROOT" ] && [ -f "$other/sysctls" ] && owner_alive "$other"; then
            saved="$other/sysctls"
            break
        fi
    done
    if [ -n "$saved" ]; then
        cp "$saved" "$ROOT/sysctls"
    else
        for key in "${SYSCTLS[@]}"; do echo "$key $(sysctl -n "$key")"; done >"$ROOT/sysctls"
    fi
    # Fixed paths outside the root that the kubelet, containerd and libcni write to: the highest
    # directory of each that does not exist yet is this node's to remove.
    local path top
    for path in /var/lib/kubelet/device-plugins /var/log/containers /var/lib/cni/results /run/containerd/s; do
        top=""
        while [ ! -e "$path" ]; do top="$path"; path="$(dirname "$path")"; done
        [ -z "$top" ] || echo "$top" >>"$ROOT/created"
    done

    # The namespace: loopback, and a veth whose other end is the host's way in (tests reach the
    # apiserver at $NODE_IP). No default route: a packet for anywhere else has nowhere to go.
    local k addrs
    addrs="$(ip -4 -o addr show)"
    for k in $(seq 0 250); do
        grep -qF " 172.30.$k." <<<"$addrs" || break
    done
    HOST_IP="172.30.$k.1"
    NODE_IP="172.30.$k.2"
    ip netns add "$NS"
    ip -n "$NS" link set lo up
    ip link add "spn$id" type veth peer name node0 netns "$NS"
    ip addr add "$HOST_IP/30" dev "spn$id"
    ip link set "spn$id" up
    ip -n "$NS" addr add "$NODE_IP/30" dev node0
    ip -n "$NS" link set node0 up
    # Locally made connections to a Service (the apiserver calling a webhook) need a route for
    # the Service range before kube-proxy's OUTPUT rules rewrite the destination: the pods' bridge,
    # made here so the route exists before the first pod (the CNI bridge plugin adopts it). A
    # Service address nothing rewrote stays on the bridge and goes unanswered, inside the namespace.
    ip -n "$NS" link add cni0 type bridge
    ip -n "$NS" link set cni0 up
    ip -n "$NS" route add "$SERVICE_CIDR" dev cni0
    # Service traffic between two pods on the bridge must cross iptables (kube-proxy's DNAT).
    if ! in_ns test -e /proc/sys/net/bridge/bridge-nf-call-iptables; then
        modprobe br_netfilter 2>/dev/null || true
    fi
    in_ns sysctl -q -w net.bridge.bridge-nf-call-iptables=1 >/dev/null ||
        die "cannot set net.bridge.bridge-nf-call-iptables in the node's namespace (the kernel needs br_netfilter)"
    unlock

    pki
    local admin_token kubelet_token
    admin_token="$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
    kubelet_token="$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
    cat >"$ROOT/pki/tokens.csv" <<EOF
$admin_token,spur-node-admin,spur-node-admin,system:masters
$kubelet_token,system:node:$NODE_NAME,system:node:$NODE_NAME,system:nodes
EOF
    chmod 600 "$ROOT/pki/tokens.csv"
    kubeconfig "$ROOT/admin.kubeconfig" spur-node-admin "$admin_token"
    kubeconfig "$ROOT/kubelet.kubeconfig" "system:node:$NODE_NAME" "$kubelet_token"

    start etcd "$BINDIR/etcd" --name spur-node --data-dir "$ROOT/etcd" --unsafe-no-fsync \
        --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
        --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
        --initial-cluster spur-node=http://127.0.0.1:2380 --log-level warn
    start kube-apiserver "$BINDIR/kube-apiserver" \
        --etcd-servers http://127.0.0.1:2379 \
        --bind-address 0.0.0.0 --secure-port 6443 --advertise-address "$NODE_IP" \
        --tls-cert-file "$ROOT/pki/apiserver.crt" --tls-private-key-file "$ROOT/pki/apiserver.key" \
        --client-ca-file "$ROOT/pki/ca.crt" --token-auth-file "$ROOT/pki/tokens.csv" \
        --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
        --allow-privileged=true \
        --service-cluster-ip-range "$SERVICE_CIDR" \
        --service-account-issuer https://kubernetes.default.svc.cluster.local \
        --service-account-key-file "$ROOT/pki/sa.pub" \
        --service-account-signing-key-file "$ROOT/pki/sa.key" \
        --kubelet-client-certificate "$ROOT/pki/apiserver-kubelet-client.crt" \
        --kubelet-client-key "$ROOT/pki/apiserver-kubelet-client.key" \
        --kubelet-certificate-authority "$ROOT/pki/ca.crt" \
        --kubelet-preferred-address-types InternalIP \
        --requestheader-client-ca-file "$ROOT/pki/front-proxy-ca.crt" \
        --requestheader-allowed-names front-proxy-client \
        --requestheader-username-headers X-Remote-User \
        --requestheader-group-headers X-Remote-Group \
        --requestheader-extra-headers-prefix X-Remote-Extra- \
        --proxy-client-cert-file "$ROOT/pki/front-proxy-client.crt" \
        --proxy-client-key-file "$ROOT/pki/front-proxy-client.key" \
        --profiling=false --v 1

    # containerd: its own root, state and socket; the CRI settings real-node.md found necessary.
    cat >"$ROOT/containerd/config.toml" <<EOF
version = 2
root = "$ROOT/containerd/root"
state = "$ROOT/containerd/state"
[grpc]
  address = "$ROOT/containerd.sock"
[ttrpc]
  address = "$ROOT/containerd.sock.ttrpc"
[debug]
  level = "warn"
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "$ROOT/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/pause:dev"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  disable_apparmor = true
  tolerate_missing_hugetlb_controller = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$CNI_BIN"
    conf_dir = "$ROOT/cni/net.d"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "$ROOT/runc"
EOF
    # Written before the first pod, or sandboxes fail with "cni plugin not initialized".
    cat >"$ROOT/cni/net.d/10-spur-node.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "$NS",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "dataDir": "$ROOT/cni/ipam",
        "ranges": [[{"subnet": "$POD_CIDR"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
    start containerd containerd --config "$ROOT/containerd/config.toml"

    wait_for "etcd" 60 etcd in_ns "$BINDIR/etcd" --version
    wait_for "the apiserver" 120 kube-apiserver kubectl_admin get --raw /readyz
    wait_for "containerd" 60 containerd ctr --address "$ROOT/containerd.sock" version

    local tar
    for tar in "$@"; do
        ctr --address "$ROOT/containerd.sock" -n k8s.io images import --no-unpack "$tar" >/dev/null ||
            die "could not import $tar into containerd"
    done

    start kube-controller-manager "$BINDIR/kube-controller-manager" \
        --kubeconfig "$ROOT/admin.kubeconfig" --authentication-kubeconfig "$ROOT/admin.kubeconfig" \
        --authorization-kubeconfig "$ROOT/admin.kubeconfig" \
        --bind-address 127.0.0.1 --leader-elect=false \
        --service-cluster-ip-range "$SERVICE_CIDR" --cluster-cidr "$CLUSTER_CIDR" \
        --allocate-node-cidrs=false \
        --root-ca-file "$ROOT/pki/ca.crt" \
        --service-account-private-key-file "$ROOT/pki/sa.key" \
        --cluster-signing-cert-file "$ROOT/pki/ca.crt" --cluster-signing-key-file "$ROOT/pki/ca.key" \
        --use-service-account-credentials=false --profiling=false --v 1
    start kube-scheduler "$BINDIR/kube-scheduler" \
        --kubeconfig "$ROOT/admin.kubeconfig" --authentication-kubeconfig "$ROOT/admin.kubeconfig" \
        --authorization-kubeconfig "$ROOT/admin.kubeconfig" \
        --bind-address 127.0.0.1 --leader-elect=false --profiling=false --v 1

    # Pods with dnsPolicy Default read this, not the host's resolver.
    echo "nameserver $NODE_IP" >"$ROOT/resolv.conf"
    # The kubelet's cgroups go under a root of this node's, so `down` finds every pod process.
    local rel sub
    rel="$(cgroup_root "$id")"
    for sub in "$CGROUP_FS"/*/; do
        mkdir -p "$sub$rel"
    done
    cat >"$ROOT/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
cgroupDriver: cgroupfs
cgroupRoot: /$rel
cgroupsPerQOS: true
failSwapOn: false
failCgroupV1: false
containerRuntimeEndpoint: unix://$ROOT/containerd.sock
podLogsDir: $ROOT/pod-logs
volumePluginDir: $ROOT/volume-plugins
resolvConf: $ROOT/resolv.conf
clusterDNS: [$NODE_IP]
clusterDomain: cluster.local
tlsCertFile: $ROOT/pki/kubelet.crt
tlsPrivateKeyFile: $ROOT/pki/kubelet.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: $ROOT/pki/ca.crt}
authorization:
  mode: AlwaysAllow
# No eviction for disk: the disk is shared with the build, and on CI's machine (252 GB, of which a
# clean build leaves a few) the kubelet's default-sized thresholds (1 % is 2.5 GB) tainted the node
# with disk-pressure in the middle of the node tier, which failed an unrelated step in a confusing
# way. A disk that really fills up fails the run plainly instead (No space left on device), and
# tests/run.sh prints the space left after each phase. "0%" turns a threshold off (the kubelet's
# parseThresholdStatement). Never collect the imported images either (there is no registry to pull
# them back from): a high threshold of 100 turns image garbage collection off.
evictionHard: {memory.available: 100Mi, nodefs.available: "0%", imagefs.available: "0%", nodefs.inodesFree: "0%", imagefs.inodesFree: "0%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
syncFrequency: 10s
fileCheckFrequency: 5s
nodeStatusUpdateFrequency: 5s
maxPods: 110
EOF
    start kubelet "$BINDIR/kubelet" --config "$ROOT/kubelet/config.yaml" \
        --kubeconfig "$ROOT/kubelet.kubeconfig" --root-dir "$ROOT/kubelet" \
        --hostname-override "$NODE_NAME" --node-ip "$NODE_IP" --v 1

    cat >"$ROOT/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $ROOT/admin.kubeconfig}
mode: iptables
clusterCIDR: $CLUSTER_CIDR
hostnameOverride: $NODE_NAME
bindAddress: 0.0.0.0
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
# nf_conntrack_max is global: leave it alone.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
    start kube-proxy "$BINDIR/kube-proxy" --config "$ROOT/kube-proxy.yaml" --v 1

    # Cluster DNS: cluster names answer, everything else is NXDOMAIN (no upstream to forward to).
    cat >"$ROOT/Corefile" <<EOF
cluster.local:53 in-addr.arpa:53 ip6.arpa:53 {
    bind $NODE_IP
    errors
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig $ROOT/admin.kubeconfig spur-node
        pods insecure
    }
    cache 5
}
.:53 {
    bind $NODE_IP
    template ANY ANY {
        rcode NXDOMAIN
    }
}
EOF
    start coredns "$BINDIR/coredns" -conf "$ROOT/Corefile"

    node_ready() { [ "$(kubectl_admin get node "$NODE_NAME" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}')" = True ]; }
    wait_for "node $NODE_NAME to be Ready" 240 kubelet node_ready
    default_sa() { kubectl_admin -n default get serviceaccount default; }
    wait_for "the default ServiceAccount" 120 kube-controller-manager default_sa
    kube_svc() { kubectl_admin -n default get endpointslice -l kubernetes.io/service-name=kubernetes -o name | grep -q .; }
    wait_for "the kubernetes Service's endpoints" 60 kube-apiserver kube_svc

    cat >"$ROOT/env" <<EOF
SPUR_NODE_ROOT=$ROOT
SPUR_NODE_NETNS=$NS
SPUR_NODE_IP=$NODE_IP
SPUR_NODE_KUBECONFIG=$ROOT/admin.kubeconfig
SPUR_NODE_CONTAINERD=$ROOT/containerd.sock
SPUR_NODE_BINDIR=$BINDIR
SPUR_NODE_CGROUP=$rel
EOF
    trap - EXIT
    log "node $NODE_NAME Ready after $((SECONDS - started)) s (root $ROOT, namespace $NS)"
    echo "$ROOT/env"
}

# ---------------------------------------------------------------------------------------------
# restart-containerd (the chaos step of the node test, issue 47)
# ---------------------------------------------------------------------------------------------
restart_containerd() {
    ROOT="$1"
    [ -f "$ROOT/env" ] || die "no node at $ROOT (no $ROOT/env)"
    NS="$(sed -n 's/^SPUR_NODE_NETNS=//p' "$ROOT/env")"
    [ -n "$NS" ] || die "$ROOT/env names no network namespace"
    local started=$SECONDS
    stop_pids "$ROOT" containerd
    # The first run's log is kept: what it said before the restart may explain a failure.
    [ -f "$ROOT/logs/containerd.log" ] && mv "$ROOT/logs/containerd.log" "$ROOT/logs/containerd.log.$(date +%s)"
    start containerd containerd --config "$ROOT/containerd/config.toml"
    wait_for "containerd" 60 containerd ctr --address "$ROOT/containerd.sock" version
    log "containerd restarted in $((SECONDS - started)) s"
}

case "${1:-}" in
    up) shift; up "$@" ;;
    down) [ $# -eq 2 ] || die "usage: $0 down ROOT"; down "$2" ;;
    cleanup) cleanup ;;
    restart-containerd) [ $# -eq 2 ] || die "usage: $0 restart-containerd ROOT"; restart_containerd "$2" ;;
    *) echo "usage: $0 up [IMAGE_TAR...] | down ROOT | cleanup | restart-containerd ROOT" >&2; exit 2 ;;
esac
