// Command routesapi-watch is Spur's test harness around the public Go client of the Signadot
// Routes API (github.com/signadot/routesapi/go-routesapi). It imports that client unchanged and
// prints what the client sees, one line per observation, so Rust tests can assert on it.
//
// Modes (-mode):
//
//	watched  the retrying cache of package watched (watched.NewBaselineWatched), polled every
//	         -poll for the routing keys in -keys; prints the initial content, then SYNCED, then
//	         one line per change.
//	router   package workload's Router (what the DevMesh sidecar uses): GetTarget(-port, key)
//	         for each key in -keys, polled every -poll; prints SYNCED once the first answer is
//	         in, then one TARGET line per key whose answer changed.
//	raw      the generated gRPC client (routesapi.NewRoutesClient) with the dial options of
//	         sdroutes at routesapi HEAD (plaintext, keepalive Time 5s, Timeout 15s); prints each
//	         WatchOp as it arrives; on a stream error prints ERROR and exits 1.
//
// Output lines (space separated, one per line, stdout flushed per line):
//
//	ADD <routingKey> <kind>/<namespace>/<name> <sandbox> <mappings>
//	REPLACE <routingKey> <kind>/<namespace>/<name> <sandbox> <mappings>
//	REMOVE <routingKey> <kind>/<namespace>/<name> <sandbox> <mappings>   (raw mode)
//	REMOVE <routingKey>                                                  (watched mode)
//	SYNCED
//	TARGET <routingKey> <port> <host:port or ->
//	INCONSISTENT <routingKey> <detail>    (watched mode: RoutesTo disagrees with Get while the
//	                                       rule stayed the same)
//	ERROR <grpc code> <message>           (raw mode)
//
// where <mappings> is "-" when empty, else "<workloadPort>-><host>:<port>[,<host>:<port>...]"
// joined by ";" in the order the server sent them.
//
// The program exits 0 on SIGTERM/SIGINT and, unless -exit-on-stdin-eof=false, when its stdin
// reaches end of file.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	routesapi "github.com/signadot/routesapi/go-routesapi"
	"github.com/signadot/routesapi/go-routesapi/watched"
	"github.com/signadot/routesapi/go-routesapi/workload"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"
)

var outMu sync.Mutex

// emit writes one line to stdout; os.Stdout is unbuffered, so each line is flushed.
func emit(format string, args ...any) {
	outMu.Lock()
	defer outMu.Unlock()
	fmt.Fprintf(os.Stdout, format+"\n", args...)
}

func mappings(r *routesapi.WorkloadRoutingRule) string {
	if len(r.GetMappings()) == 0 {
		return "-"
	}
	parts := make([]string, 0, len(r.GetMappings()))
	for _, m := range r.GetMappings() {
		dests := make([]string, 0, len(m.GetDestinations()))
		for _, d := range m.GetDestinations() {
			dests = append(dests, fmt.Sprintf("%s:%d", d.GetHost(), d.GetPort()))
		}
		parts = append(parts, fmt.Sprintf("%d->%s", m.GetWorkloadPort(), strings.Join(dests, ",")))
	}
	return strings.Join(parts, ";")
}

// describe renders a rule as "<routingKey> <kind>/<namespace>/<name> <sandbox> <mappings>".
func describe(r *routesapi.WorkloadRoutingRule) string {
	b := r.GetBaseline()
	return fmt.Sprintf("%s %s/%s/%s %s %s", r.GetRoutingKey(), b.GetKind(), b.GetNamespace(),
		b.GetName(), r.GetDestinationSandbox().GetName(), mappings(r))
}

func splitKeys(s string) []string {
	var keys []string
	for _, k := range strings.Split(s, ",") {
		if k = strings.TrimSpace(k); k != "" {
			keys = append(keys, k)
		}
	}
	return keys
}

func main() {
	var (
		addr      = flag.String("addr", "localhost:7777", "route server gRPC address")
		mode      = flag.String("mode", "watched", "watched | router | raw")
		kind      = flag.String("kind", "Deployment", "baseline workload kind")
		namespace = flag.String("namespace", "", "baseline workload namespace")
		name      = flag.String("name", "", "baseline workload name")
		keys      = flag.String("keys", "", "comma-separated routing keys to poll (watched, router modes)")
		port      = flag.Int("port", 0, "workload port for GetTarget (router mode)")
		poll      = flag.Duration("poll", 50*time.Millisecond, "poll interval (watched, router modes)")
		stdinEOF  = flag.Bool("exit-on-stdin-eof", true, "exit when stdin reaches end of file")
		verbose   = flag.Bool("v", false, "debug logging on stderr")
	)
	flag.Parse()

	level := slog.LevelInfo
	if *verbose {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))

	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer cancel()
	if *stdinEOF {
		go func() {
			_, _ = io.Copy(io.Discard, os.Stdin)
			cancel()
		}()
	}

	baseline := &routesapi.BaselineWorkload{Kind: *kind, Namespace: *namespace, Name: *name}
	var err error
	switch *mode {
	case "watched":
		err = runWatched(ctx, log, *addr, baseline, splitKeys(*keys), *poll)
	case "router":
		err = runRouter(ctx, log, *addr, baseline, splitKeys(*keys), int32(*port), *poll)
	case "raw":
		err = runRaw(ctx, *addr, baseline)
	default:
		err = fmt.Errorf("unknown -mode %q", *mode)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "routesapi-watch:", err)
		os.Exit(1)
	}
}

// waitSynced runs first (which blocks until the client is synced) and returns true once it
// returned, or false if ctx ended first.
func waitSynced(ctx context.Context, first func()) bool {
	done := make(chan struct{})
	go func() {
		first()
		close(done)
	}()
	select {
	case <-done:
		return true
	case <-ctx.Done():
		return false
	}
}

func runWatched(ctx context.Context, log *slog.Logger, addr string, b *routesapi.BaselineWorkload, keys []string, poll time.Duration) error {
	if len(keys) == 0 {
		return fmt.Errorf("-keys is required in watched mode")
	}
	w, err := watched.NewBaselineWatched(ctx, &watched.Config{Addr: addr, Log: log}, b)
	if err != nil {
		return err
	}
	// Get blocks until the first SYNCED.
	if !waitSynced(ctx, func() { w.Get(keys[0]) }) {
		return nil
	}
	seen := map[string]string{}
	check := func() {
		for _, k := range keys {
			r := w.Get(k)
			prev, had := seen[k]
			if r == nil {
				if had {
					delete(seen, k)
					emit("REMOVE %s", k)
				}
				continue
			}
			// Get and RoutesTo take the cache's lock one after the other: an op that lands
			// between them (the rule removed) is not an inconsistency. Get again: the cache
			// stores a fresh copy per ADD/REPLACE, so the same pointer means no op touched the
			// key between the two Gets, and RoutesTo, read between them, must agree.
			if !w.RoutesTo(k, r.GetDestinationSandbox().GetName()) && w.Get(k) == r {
				emit("INCONSISTENT %s RoutesTo(%q) is false", k, r.GetDestinationSandbox().GetName())
			}
			cur := describe(r)
			switch {
			case !had:
				emit("ADD %s", cur)
			case prev != cur:
				emit("REPLACE %s", cur)
			default:
				continue
			}
			seen[k] = cur
		}
	}
	check()
	emit("SYNCED")
	t := time.NewTicker(poll)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			check()
		}
	}
}

func runRouter(ctx context.Context, log *slog.Logger, addr string, b *routesapi.BaselineWorkload, keys []string, port int32, poll time.Duration) error {
	if len(keys) == 0 || port == 0 {
		return fmt.Errorf("-keys and -port are required in router mode")
	}
	r, err := workload.NewRouter(&workload.Config{
		RouteServerAddr: addr,
		Baseline:        &watched.Baseline{Kind: b.Kind, Namespace: b.Namespace, Name: b.Name},
		Log:             log,
	})
	if err != nil {
		return err
	}
	if !waitSynced(ctx, func() { r.GetTarget(port, keys[0]) }) {
		return nil
	}
	emit("SYNCED")
	seen := map[string]string{}
	check := func() {
		for _, k := range keys {
			target := r.GetTarget(port, k)
			if target == "" {
				target = "-"
			}
			if prev, had := seen[k]; had && prev == target {
				continue
			}
			seen[k] = target
			emit("TARGET %s %d %s", k, port, target)
		}
	}
	check()
	t := time.NewTicker(poll)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			check()
		}
	}
}

func runRaw(ctx context.Context, addr string, b *routesapi.BaselineWorkload) error {
	conn, err := grpc.Dial(addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{
			Time:    5 * time.Second,
			Timeout: 15 * time.Second,
		}))
	if err != nil {
		return err
	}
	defer conn.Close()
	stream, err := routesapi.NewRoutesClient(conn).WatchWorkloadRoutingRules(ctx,
		&routesapi.WorkloadRoutingRulesRequest{BaselineWorkload: b})
	if err != nil {
		return err
	}
	for {
		op, err := stream.Recv()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			s := status.Convert(err)
			emit("ERROR %s %s", s.Code(), strings.ReplaceAll(s.Message(), "\n", " "))
			os.Exit(1)
		}
		if op.GetOp() == routesapi.WatchOp_SYNCED {
			emit("SYNCED")
			continue
		}
		emit("%s %s", op.GetOp(), describe(op.GetRoute()))
	}
}
