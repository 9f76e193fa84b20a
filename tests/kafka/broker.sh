#!/usr/bin/env bash
# One Apache Kafka 3.9.2 broker (KRaft, broker and controller in one JVM) on 127.0.0.1:9092, in
# the foreground until Ctrl-C: the broker of the README's demo with records
# (`cargo run -p spur-demo -- --kafka 127.0.0.1:9092`). Any other Kafka 3.x/4.x cluster of one
# broker will do as well.
#
# Needs java and mvn (Debian: openjdk-17-jdk-headless maven) for tests/kafka/fetch.sh, which
# resolves the broker from Maven Central on first use (about a minute, then cached).
#   KAFKA_CLIENT_PORT  client port (default 9092; the controller takes the next one)
#   KAFKA_DATA  log directory (default: a new temporary directory, removed when the broker
#               stops, so every run starts empty)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
kafka="$("$here/fetch.sh" | tail -n 1)"
# $kafka holds log4j.properties, which log4j finds on the classpath.
export CLASSPATH="$kafka/lib/*:$kafka/classes:$kafka"
export KAFKA_ADVERTISED_HOST=127.0.0.1 KAFKA_LISTEN_HOST=127.0.0.1
if [ -z "${KAFKA_DATA:-}" ]; then
    # A directory of our own: removed when the broker stops (Ctrl-C included).
    KAFKA_DATA="$(mktemp -d -t spur-kafka.XXXXXX)"
    trap 'rm -rf "$KAFKA_DATA"' EXIT
    trap 'exit 130' INT TERM
fi
export KAFKA_DATA
echo "Kafka broker on 127.0.0.1:${KAFKA_CLIENT_PORT:-9092}, data in $KAFKA_DATA (Ctrl-C stops it)" >&2
sh "$here/../node/spur-kafka-broker.sh"
