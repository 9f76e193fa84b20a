#!/usr/bin/env bash
# Resolves the Apache Kafka broker 3.9.2 (KRaft) and its Java client from Maven Central into a
# cache, and compiles the Java client harness (Probe.java) against them:
#   $OUT/lib/*.jar    the broker, kafka-clients and their dependencies (57 jars, about 46 MB)
#   $OUT/classes/     Probe.class, rebuilt when Probe.java changes
# OUT defaults to ~/.cache/spur/kafka/3.9.2. Needs java (17) and mvn (tests/run.sh installs
# Debian's openjdk-17-jdk-headless and maven). Prints $OUT as its last line; tests/run.sh exports
# it as SPUR_KAFKA_DIR. About a minute on a fresh machine, a no-op afterwards.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-${XDG_CACHE_HOME:-$HOME/.cache}/spur/kafka/3.9.2}"
for tool in java javac mvn; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "tests/kafka/fetch.sh: '$tool' is not installed (Debian: openjdk-17-jdk-headless, maven)" >&2
        exit 127
    fi
done
mkdir -p "$out"
# The jar list is complete once `lib.done` names this pom's hash: a run cut short starts over.
pom_hash="$(sha256sum "$here/pom.xml" | cut -c1-16)"
if [ "$(cat "$out/lib.done" 2>/dev/null)" != "$pom_hash" ]; then
    rm -rf "$out/lib"
    mvn -q -B -f "$here/pom.xml" dependency:copy-dependencies \
        -DincludeScope=runtime -DoutputDirectory="$out/lib" >&2
    echo "$pom_hash" >"$out/lib.done"
fi
probe_hash="$(cat "$here/Probe.java" "$here/log4j.properties" | sha256sum | cut -c1-16)"
if [ "$(cat "$out/classes.done" 2>/dev/null)" != "$probe_hash" ]; then
    rm -rf "$out/classes"
    mkdir -p "$out/classes"
    javac -nowarn -d "$out/classes" -cp "$out/lib/*" "$here/Probe.java" >&2
    cp "$here/log4j.properties" "$out/log4j.properties"
    echo "$probe_hash" >"$out/classes.done"
fi
echo "$out"
