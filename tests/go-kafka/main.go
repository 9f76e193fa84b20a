// Test-harness only: kafka-client, franz-go (unchanged, github.com/twmb/franz-go) as a Kafka
// producer and group consumer, which the Rust Kafka tests run against a real broker directly and
// through Spur's relay. Its own module so franz-go's dependencies never move the other Go
// harnesses'.
//
//	kafka-client produce BOOTSTRAP TOPIC CODEC PREFIX COUNT KEY
//	    COUNT records with values PREFIX-0 .. PREFIX-(COUNT-1), compressed with CODEC (none, gzip,
//	    snappy, lz4, zstd), each with the header `baggage: sd-routing-key=KEY` unless KEY is "-".
//	kafka-client stream BOOTSTRAP TOPIC PREFIX COUNT KEY/N PAUSE_MS
//	    COUNT records as `produce` (no compression), one at a time, PAUSE_MS apart, each acked
//	    before the next; every N-th carries the header (the others none); prints
//	    "sent VALUE TIMESTAMP_MS" per record.
//	kafka-client consume BOOTSTRAP TOPIC GROUP COUNT TIMEOUT_MS
//	    Reads as a member of GROUP from the earliest offset until COUNT records came or
//	    TIMEOUT_MS passed; prints "record PARTITION OFFSET VALUE" per record; commits.
//	    COUNT 0 reads until TIMEOUT_MS or SIGTERM as a long-running worker would: it commits each
//	    poll's records before printing them (so a record is printed at most once), and a fetch
//	    error is logged and retried rather than fatal.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

func main() {
	if len(os.Args) < 2 {
		fail("usage: kafka-client produce|consume ...")
	}
	switch os.Args[1] {
	case "produce":
		if len(os.Args) != 8 {
			fail("usage: kafka-client produce BOOTSTRAP TOPIC CODEC PREFIX COUNT KEY")
		}
		produce(os.Args[2], os.Args[3], os.Args[4], os.Args[5], atoi(os.Args[6]), os.Args[7])
	case "stream":
		if len(os.Args) != 8 {
			fail("usage: kafka-client stream BOOTSTRAP TOPIC PREFIX COUNT KEY/N PAUSE_MS")
		}
		stream(os.Args[2], os.Args[3], os.Args[4], atoi(os.Args[5]), os.Args[6], atoi(os.Args[7]))
	case "consume":
		if len(os.Args) != 7 {
			fail("usage: kafka-client consume BOOTSTRAP TOPIC GROUP COUNT TIMEOUT_MS")
		}
		consume(os.Args[2], os.Args[3], os.Args[4], atoi(os.Args[5]), atoi(os.Args[6]))
	default:
		fail("unknown command " + os.Args[1])
	}
}

func fail(msg string) {
	fmt.Fprintln(os.Stderr, msg)
	os.Exit(2)
}

func atoi(s string) int {
	n, err := strconv.Atoi(s)
	if err != nil {
		fail(err.Error())
	}
	return n
}

func codec(name string) kgo.CompressionCodec {
	switch name {
	case "none":
		return kgo.NoCompression()
	case "gzip":
		return kgo.GzipCompression()
	case "snappy":
		return kgo.SnappyCompression()
	case "lz4":
		return kgo.Lz4Compression()
	case "zstd":
		return kgo.ZstdCompression()
	}
	fail("unknown codec " + name)
	return kgo.NoCompression()
}

func produce(bootstrap, topic, codecName, prefix string, count int, key string) {
	cl, err := kgo.NewClient(
		kgo.SeedBrokers(bootstrap),
		kgo.DefaultProduceTopic(topic),
		kgo.ProducerBatchCompression(codec(codecName)),
		kgo.ProducerLinger(20*time.Millisecond),
	)
	if err != nil {
		fail(err.Error())
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for i := 0; i < count; i++ {
		r := &kgo.Record{Value: []byte(fmt.Sprintf("%s-%d", prefix, i))}
		if key != "-" {
			r.Headers = []kgo.RecordHeader{{Key: "baggage", Value: []byte("sd-routing-key=" + key)}}
		}
		cl.Produce(ctx, r, func(_ *kgo.Record, err error) {
			if err != nil {
				fail("produce: " + err.Error())
			}
		})
	}
	if err := cl.Flush(ctx); err != nil {
		fail("flush: " + err.Error())
	}
	fmt.Printf("produced %d\n", count)
}

func stream(bootstrap, topic, prefix string, count int, keyEvery string, pauseMs int) {
	key, everyText, ok := strings.Cut(keyEvery, "/")
	if !ok {
		fail("KEY/N expected, got " + keyEvery)
	}
	every := atoi(everyText)
	if every < 1 {
		fail("N must be at least 1")
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(bootstrap), kgo.DefaultProduceTopic(topic))
	if err != nil {
		fail(err.Error())
	}
	defer cl.Close()
	for i := 0; i < count; i++ {
		value := fmt.Sprintf("%s-%d", prefix, i)
		r := &kgo.Record{Key: []byte(value), Value: []byte(value)}
		if i%every == 0 {
			r.Headers = []kgo.RecordHeader{{Key: "baggage", Value: []byte("sd-routing-key=" + key)}}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		res := cl.ProduceSync(ctx, r)
		cancel()
		sent, err := res.First()
		if err != nil {
			fail("produce " + value + ": " + err.Error())
		}
		fmt.Printf("sent %s %d\n", value, sent.Timestamp.UnixMilli())
		time.Sleep(time.Duration(pauseMs) * time.Millisecond)
	}
}

func consume(bootstrap, topic, group string, count, timeoutMs int) {
	if count == 0 {
		worker(bootstrap, topic, group, timeoutMs)
		return
	}
	cl := groupClient(bootstrap, topic, group)
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(timeoutMs)*time.Millisecond)
	defer cancel()
	seen := 0
	for seen < count && ctx.Err() == nil {
		fetches := cl.PollFetches(ctx)
		fetches.EachError(func(t string, p int32, err error) {
			if ctx.Err() == nil {
				fail(fmt.Sprintf("fetch %s/%d: %v", t, p, err))
			}
		})
		fetches.EachRecord(func(r *kgo.Record) {
			fmt.Printf("record %d %d %s\n", r.Partition, r.Offset, r.Value)
			seen++
		})
	}
	commitCtx, cancelCommit := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancelCommit()
	if err := cl.CommitUncommittedOffsets(commitCtx); err != nil {
		fail("commit: " + err.Error())
	}
}

// groupClient is a member of GROUP reading TOPIC from the earliest offset, read_committed,
// committing only when told.
func groupClient(bootstrap, topic, group string) *kgo.Client {
	cl, err := kgo.NewClient(
		kgo.SeedBrokers(bootstrap),
		kgo.ConsumerGroup(group),
		kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.DisableAutoCommit(),
	)
	if err != nil {
		fail(err.Error())
	}
	return cl
}

// worker is `consume` with COUNT 0: a long-running group member, stopped by SIGTERM.
func worker(bootstrap, topic, group string, timeoutMs int) {
	cl := groupClient(bootstrap, topic, group)
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(timeoutMs)*time.Millisecond)
	defer cancel()
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM, os.Interrupt)
	defer stop()
	for ctx.Err() == nil {
		fetches := cl.PollFetches(ctx)
		fetches.EachError(func(t string, p int32, err error) {
			if ctx.Err() == nil {
				fmt.Fprintf(os.Stderr, "fetch %s/%d: %v (retrying)\n", t, p, err)
			}
		})
		var records []*kgo.Record
		fetches.EachRecord(func(r *kgo.Record) { records = append(records, r) })
		if len(records) == 0 {
			continue
		}
		// Committed before printed: a record is printed at most once. A failed commit is
		// retried (the coordinator may be moving); one that keeps failing for 30 s leaves the
		// records to whoever owns their partitions next, unprinted here.
		var err error
		for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); {
			commitCtx, cancelCommit := context.WithTimeout(context.Background(), 10*time.Second)
			err = cl.CommitRecords(commitCtx, records...)
			cancelCommit()
			if err == nil {
				break
			}
			time.Sleep(500 * time.Millisecond)
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "commit: %v (records left to the group)\n", err)
			continue
		}
		for _, r := range records {
			fmt.Printf("record %d %d %s\n", r.Partition, r.Offset, r.Value)
		}
	}
}
