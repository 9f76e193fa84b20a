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
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
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
	flag.Parse()
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
