#!/bin/sh
# Entrypoint of localhost/spur-kafka:dev as a broker: one Apache Kafka 3.9 node in KRaft mode
# (broker and controller in one process), for the node tier's Kafka tests; also run on a
# workstation by tests/kafka/broker.sh (the README's demo with records).
#
#   KAFKA_ADVERTISED_HOST  (required) the name clients reach it by, e.g. kafka.NS.svc.cluster.local
#   KAFKA_DATA             the log directory (default /var/lib/kafka; mount an emptyDir there)
#   KAFKA_HEAP             the JVM's -Xmx (default 512m)
#   KAFKA_LISTEN_HOST      the address clients connect to (default 0.0.0.0)
#   KAFKA_CLIENT_PORT      their port (default 9092); the controller's is the next one. (Not
#                          KAFKA_PORT: the kubelet sets that, to `tcp://IP:9092`, in the pods of
#                          a namespace with a Service named kafka.)
#
# Clients connect on KAFKA_CLIENT_PORT (PLAINTEXT, advertised as
# KAFKA_ADVERTISED_HOST:KAFKA_CLIENT_PORT); the controller listens on 127.0.0.1 only. Topics are
# not created automatically (the tests create them with 3 partitions), so a typo in a topic name
# fails instead of making a new one. The storage is formatted on first start and reused
# afterwards (a container restart keeps the log).
set -eu
: "${KAFKA_ADVERTISED_HOST:?KAFKA_ADVERTISED_HOST is required (the name clients reach this broker by)}"
data=${KAFKA_DATA:-/var/lib/kafka}
heap=${KAFKA_HEAP:-512m}
host=${KAFKA_LISTEN_HOST:-0.0.0.0}
port=${KAFKA_CLIENT_PORT:-9092}
controller=$((port + 1))
mkdir -p "$data/log"
props=$data/server.properties
cat >"$props" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$controller
listeners=PLAINTEXT://$host:$port,CONTROLLER://127.0.0.1:$controller
advertised.listeners=PLAINTEXT://${KAFKA_ADVERTISED_HOST}:$port
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
log.dirs=$data/log
num.partitions=3
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
PROPS
if [ ! -f "$data/log/meta.properties" ]; then
    # A cluster id is 16 random bytes, base64url without padding.
    id=$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=')
    java kafka.tools.StorageTool format -t "$id" -c "$props"
fi
exec java "-Xmx$heap" -XX:+UseSerialGC kafka.Kafka "$props"
