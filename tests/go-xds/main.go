// Command xds-client is a test harness: a proxyless gRPC client built on grpc-go's real,
// unchanged xDS client (the `xds:///` resolver registered by google.golang.org/grpc/xds), which
// the Rust tests run against Spur's xDS (ADS) server. It takes its listeners, routes, clusters
// and endpoints from that server and sends plaintext h2c calls to the backends it is given.
//
// Usage:
//
//	xds-client -target xds:///api.default.svc:80 [-bootstrap FILE] [-timeout 5s]
//
// The xDS bootstrap JSON is read from -bootstrap, else from the file named by GRPC_XDS_BOOTSTRAP
// (or the contents of GRPC_XDS_BOOTSTRAP_CONFIG), which grpc-go itself reads. grpc-go parses it
// when the channel starts resolving, so a bootstrap it rejects shows as every call answering
// "error code=Unavailable msg=xds: failed to create xds-client: ...".
//
// It dials once, prints "ready", then reads one command per line from stdin and writes exactly
// one line to stdout for each:
//
//	call [name=value ...]  a unary /spur.demo.v1.Demo/Hello call (HelloRequest{name:"xds"}) with
//	                       these request metadata pairs (split at the first '='; values may hold
//	                       ',', ';' and '=' but no spaces). Answers
//	                       "ok served_by=<HelloReply.served_by> trailer=<x-served-by trailer>" or
//	                       "error code=<grpc code, e.g. Unavailable> msg=<message, one line>".
//	quit                   exits 0 (so does EOF on stdin).
//
// Anything else answers "error code=InvalidArgument msg=unknown command ...". grpc-go logs go to
// stderr as usual (set GRPC_GO_LOG_SEVERITY_LEVEL=info and GRPC_GO_LOG_VERBOSITY_LEVEL=99 to see
// the xDS client's own logs).
//
// Benchmark mode (many xDS clients in one process, for measuring xDS push latency):
//
//	xds-client -clients N -bootstrap FILE -target xds:///HOST:PORT [-node-prefix PREFIX]
//
// reads FILE once and creates N independent channels, channel i (0 <= i < N) with its own xDS
// client whose bootstrap is FILE's with node.id set to "PREFIX-i" (PREFIX defaults to FILE's
// node.id), hence its own connection and ADS stream to the xDS server, subscribed to the target's
// listener and from there its route configuration, clusters and endpoints. No calls are made. It
// prints "ready" once all N are created and connecting, then waits for EOF on stdin (or a line
// "quit"), closes them all and exits 0. Nothing else goes to stdout; errors go to stderr with
// exit code 1.
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/xds" // also registers the xds:/// resolver, balancers and filters
	"google.golang.org/protobuf/encoding/protowire"
)

const helloMethod = "/spur.demo.v1.Demo/Hello"

func main() {
	target := flag.String("target", "", "xDS target, e.g. xds:///api.default.svc:80 (required)")
	bootstrapFile := flag.String("bootstrap", "", "xDS bootstrap JSON file (default: grpc-go reads GRPC_XDS_BOOTSTRAP / GRPC_XDS_BOOTSTRAP_CONFIG)")
	timeout := flag.Duration("timeout", 5*time.Second, "deadline of each call")
	clients := flag.Int("clients", 0, "benchmark mode: create this many xDS clients (needs -bootstrap), make no calls")
	nodePrefix := flag.String("node-prefix", "", "benchmark mode: client i has node.id PREFIX-i (default: the bootstrap's node.id)")
	flag.Parse()
	if *clients != 0 || *nodePrefix != "" {
		if *clients <= 0 || *target == "" || *bootstrapFile == "" || flag.NArg() != 0 {
			fmt.Fprintln(os.Stderr, "usage: xds-client -clients N -bootstrap FILE -target xds:///HOST:PORT [-node-prefix PREFIX]")
			os.Exit(1)
		}
		if err := runMany(*clients, *bootstrapFile, *target, *nodePrefix); err != nil {
			fmt.Fprintln(os.Stderr, "xds-client:", err)
			os.Exit(1)
		}
		return
	}
	if *target == "" || flag.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "usage: xds-client -target xds:///HOST:PORT [-bootstrap FILE] [-timeout 5s]")
		os.Exit(2)
	}

	builder, err := resolverFor(*bootstrapFile)
	if err != nil {
		fmt.Fprintln(os.Stderr, "xds-client:", err)
		os.Exit(2)
	}
	c, err := newClient(*target, builder)
	if err != nil {
		fmt.Fprintln(os.Stderr, "xds-client:", err)
		os.Exit(1)
	}
	defer c.conn.Close()

	out := bufio.NewWriter(os.Stdout)
	say := func(line string) {
		out.WriteString(line)
		out.WriteByte('\n')
		out.Flush()
	}
	say("ready")

	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 64*1024), 1024*1024)
	for in.Scan() {
		fields := strings.Fields(in.Text())
		if len(fields) == 0 {
			say("error code=InvalidArgument msg=empty command")
			continue
		}
		switch fields[0] {
		case "quit":
			return
		case "call":
			say(c.call(fields[1:], *timeout))
		default:
			say("error code=InvalidArgument msg=unknown command " + oneLine(fields[0]))
		}
	}
}

// resolverFor returns the xDS resolver to dial with. With a bootstrap file it is a resolver of
// its own built from that file's contents (grpc-go reads GRPC_XDS_BOOTSTRAP only once, when the
// process starts, so setting the variable here would be too late); without one it is nil: the
// globally registered xds resolver, which reads GRPC_XDS_BOOTSTRAP / GRPC_XDS_BOOTSTRAP_CONFIG.
//
// A later "many clients in one process" mode can call this once per client with a different
// bootstrap (different node.id): xds.NewXDSResolverWithConfigForTesting creates a new xDS client
// pool, hence a new xDS client and ADS stream, every time the returned builder builds a resolver,
// i.e. once per grpc.ClientConn using it. The global resolver instead shares one xDS client per
// target string (xdsclient.DefaultPool keyed by target) and one bootstrap for the whole process.
func resolverFor(bootstrapFile string) (resolver.Builder, error) {
	if bootstrapFile == "" {
		if os.Getenv("GRPC_XDS_BOOTSTRAP") == "" && os.Getenv("GRPC_XDS_BOOTSTRAP_CONFIG") == "" {
			return nil, errors.New("no xDS bootstrap: pass -bootstrap FILE or set GRPC_XDS_BOOTSTRAP")
		}
		return nil, nil
	}
	contents, err := os.ReadFile(bootstrapFile)
	if err != nil {
		return nil, fmt.Errorf("reading bootstrap: %w", err)
	}
	b, err := xds.NewXDSResolverWithConfigForTesting(contents)
	if err != nil {
		return nil, fmt.Errorf("bootstrap %s: %w", bootstrapFile, err)
	}
	return b, nil
}

// client is one gRPC channel to an xDS target.
type client struct {
	conn *grpc.ClientConn
}

// newClient creates the channel (with builder as its resolver when non-nil) and starts
// connecting at once, so the xDS client opens its ADS stream before the first call.
func newClient(target string, builder resolver.Builder) (*client, error) {
	opts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	if builder != nil {
		opts = append(opts, grpc.WithResolvers(builder))
	}
	conn, err := grpc.NewClient(target, opts...)
	if err != nil {
		return nil, fmt.Errorf("dialing %s: %w", target, err)
	}
	conn.Connect()
	return &client{conn: conn}, nil
}

// runMany is the benchmark mode: n channels to target, each with an xDS client of its own (node.id
// prefix-i), "ready" on stdout once all are connecting, then closed at EOF or "quit" on stdin.
func runMany(n int, bootstrapFile, target, prefix string) error {
	if !strings.HasPrefix(target, "xds:") {
		return fmt.Errorf("target %q is not an xds: target (xds:///HOST:PORT)", target)
	}
	contents, err := os.ReadFile(bootstrapFile)
	if err != nil {
		return fmt.Errorf("reading bootstrap: %w", err)
	}
	// UseNumber keeps numbers exactly as written when the document is encoded again.
	dec := json.NewDecoder(bytes.NewReader(contents))
	dec.UseNumber()
	var doc map[string]any
	if err := dec.Decode(&doc); err != nil {
		return fmt.Errorf("bootstrap %s: %w", bootstrapFile, err)
	}
	node, _ := doc["node"].(map[string]any)
	if node == nil {
		if doc["node"] != nil {
			return fmt.Errorf("bootstrap %s: node is not an object", bootstrapFile)
		}
		node = map[string]any{}
		doc["node"] = node
	}
	if prefix == "" {
		prefix, _ = node["id"].(string)
		if prefix == "" {
			return fmt.Errorf("bootstrap %s has no node.id: pass -node-prefix", bootstrapFile)
		}
	}
	// One bootstrap per client, encoded here (doc is not safe to share between goroutines).
	configs := make([][]byte, n)
	for i := range configs {
		node["id"] = fmt.Sprintf("%s-%d", prefix, i)
		if configs[i], err = json.Marshal(doc); err != nil {
			return fmt.Errorf("encoding bootstrap: %w", err)
		}
	}

	conns := make([]*grpc.ClientConn, n)
	closeAll := func() {
		forEach(n, func(i int) error {
			if conns[i] != nil {
				conns[i].Close()
			}
			return nil
		})
	}
	// Creating a channel builds its xDS client inline (Connect() builds the resolver), which costs
	// a bootstrap parse and a new transport; a few workers make 1000 of them quick.
	err = forEach(n, func(i int) error {
		b, err := xds.NewXDSResolverWithConfigForTesting(configs[i])
		if err != nil {
			return fmt.Errorf("client %d: %w", i, err)
		}
		rb := &recordingBuilder{Builder: b}
		conn, err := grpc.NewClient(target,
			grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithResolvers(rb),
			// Without calls, the default 30 min idle timeout would shut the resolver, hence the
			// xDS client and its ADS stream, down in the middle of a long benchmark.
			// (Idle connections hold no read or write buffer: grpc-go v1.85 pools both by default.)
			grpc.WithIdleTimeout(0),
		)
		if err != nil {
			return fmt.Errorf("client %d: dialing %s: %w", i, target, err)
		}
		conns[i] = conn
		conn.Connect() // leaves idle at once: builds the resolver, hence the xDS client and its watch
		if err := rb.result(); err != nil {
			return fmt.Errorf("client %d: %w", i, err)
		}
		configs[i] = nil
		return nil
	})
	if err != nil {
		closeAll()
		return err
	}
	configs = nil

	if _, err := os.Stdout.WriteString("ready\n"); err != nil {
		closeAll()
		return fmt.Errorf("writing ready: %w", err)
	}
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 64*1024), 1024*1024)
	for in.Scan() {
		if strings.TrimSpace(in.Text()) == "quit" {
			break
		}
	}
	closeAll()
	return nil
}

// forEach runs f(0) ... f(n-1) on a few goroutines and returns the first error; after an error
// it starts no new ones.
func forEach(n int, f func(i int) error) error {
	workers := min(n, 32)
	next := make(chan int)
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		firstErr error
	)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				if err := f(i); err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					mu.Unlock()
				}
			}
		}()
	}
	for i := 0; i < n; i++ {
		mu.Lock()
		failed := firstErr != nil
		mu.Unlock()
		if failed {
			break
		}
		next <- i
	}
	close(next)
	wg.Wait()
	return firstErr
}

// recordingBuilder remembers whether its resolver was built and how that went: grpc-go builds it
// inline in Connect() and otherwise only reports a failure (e.g. a bootstrap it rejects) to calls.
type recordingBuilder struct {
	resolver.Builder
	mu    sync.Mutex
	built bool
	err   error
}

func (b *recordingBuilder) Build(t resolver.Target, cc resolver.ClientConn, opts resolver.BuildOptions) (resolver.Resolver, error) {
	r, err := b.Builder.Build(t, cc, opts)
	b.mu.Lock()
	b.built, b.err = true, err
	b.mu.Unlock()
	return r, err
}

func (b *recordingBuilder) result() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.built {
		return errors.New("the xDS resolver was not built by Connect()")
	}
	return b.err
}

// call performs one Hello call with the given name=value metadata pairs and returns its result
// line.
func (c *client) call(pairs []string, timeout time.Duration) string {
	md := metadata.MD{}
	for _, p := range pairs {
		name, value, ok := strings.Cut(p, "=")
		if !ok || name == "" {
			return "error code=InvalidArgument msg=metadata pair without name=value: " + oneLine(p)
		}
		md.Append(name, value)
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	ctx = metadata.NewOutgoingContext(ctx, md)

	// HelloRequest{ string name = 1; }
	req := protowire.AppendString(protowire.AppendTag(nil, 1, protowire.BytesType), "xds")
	var reply []byte
	var trailer metadata.MD
	err := c.conn.Invoke(ctx, helloMethod, req, &reply, grpc.ForceCodec(rawCodec{}), grpc.Trailer(&trailer))
	if err != nil {
		st := status.Convert(err)
		return fmt.Sprintf("error code=%s msg=%s", st.Code(), oneLine(st.Message()))
	}
	servedBy, err := servedByField(reply)
	if err != nil {
		return fmt.Sprintf("error code=%s msg=bad HelloReply: %s", codes.Internal, oneLine(err.Error()))
	}
	return fmt.Sprintf("ok served_by=%s trailer=%s", oneLine(servedBy), oneLine(strings.Join(trailer.Get("x-served-by"), ",")))
}

// servedByField decodes HelloReply{ string message = 1; string served_by = 2; string
// routing_key = 3; } and returns served_by.
func servedByField(b []byte) (string, error) {
	servedBy := ""
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return "", protowire.ParseError(n)
		}
		b = b[n:]
		if num == 2 && typ == protowire.BytesType {
			v, n := protowire.ConsumeString(b)
			if n < 0 {
				return "", protowire.ParseError(n)
			}
			servedBy = v
			b = b[n:]
			continue
		}
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return "", protowire.ParseError(n)
		}
		b = b[n:]
	}
	return servedBy, nil
}

// rawCodec passes already-encoded protobuf bytes through: Marshal takes a []byte, Unmarshal
// fills a *[]byte. Its empty name adds no content-subtype, so calls carry content-type
// application/grpc exactly as generated stubs' do (grpc-go's xDS route matching sees it too).
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) {
	b, ok := v.([]byte)
	if !ok {
		return nil, fmt.Errorf("rawCodec: cannot marshal %T", v)
	}
	return b, nil
}

func (rawCodec) Unmarshal(data []byte, v any) error {
	p, ok := v.(*[]byte)
	if !ok {
		return fmt.Errorf("rawCodec: cannot unmarshal into %T", v)
	}
	*p = append((*p)[:0], data...)
	return nil
}

func (rawCodec) Name() string { return "" }

// oneLine keeps a value on one output line.
func oneLine(s string) string {
	return strings.NewReplacer("\r\n", " ", "\n", " ", "\r", " ").Replace(s)
}
