// Command monitoring-check checks Spur's Grafana dashboards (charts/spur/files/dashboards) the
// way a Grafana would read them, without running Grafana (AGPL, left alone): each file is decoded
// strictly into the Grafana Foundation SDK's dashboard model (unknown fields, wrong types and
// missing required fields refused; panel options and queries decoded by their plugin's type),
// and every Prometheus query is parsed by Prometheus' own PromQL parser, Grafana's range
// variables replaced by a duration first. It also checks what the schema cannot: a uid and a
// title, unique panel ids, every panel placed on the 24-column grid without overlapping another,
// a title and a description on every panel, a query on every non-row panel, and every query
// naming its datasource through the dashboard's `datasource` variable.
//
// A Prometheus rule file (`.yaml`/`.yml`) among the arguments is parsed as Prometheus loads it
// (rulefmt, which promtool's checks use too) for the metric names its expressions read.
//
// Usage: monitoring-check FILE...   (dashboards `.json`, rule files `.yaml`/`.yml`)
//
// Prints one line per metric name the queries read (`METRIC <file> <name>`), then `OK <n>` with
// the number of files; on any problem prints `ERROR <file>: <problem>` lines and exits 1.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/grafana/grafana-foundation-sdk/go/cog/plugins"
	"github.com/grafana/grafana-foundation-sdk/go/dashboard"
	"github.com/grafana/grafana-foundation-sdk/go/prometheus"
	"github.com/prometheus/common/model"
	"github.com/prometheus/common/promslog"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"
)

// Grafana's interval variables, as Prometheus durations for parsing.
var grafanaVars = strings.NewReplacer(
	"$__rate_interval", "1m",
	"${__rate_interval}", "1m",
	"$__interval", "1m",
	"${__interval}", "1m",
	"$__range", "1h",
	"${__range}", "1h",
)

// Prometheus' parser with its default functions, as the server has them.
var promql = parser.NewParser(parser.Options{})

type check struct {
	file     string
	problems []string
	metrics  map[string]bool
}

func (c *check) fail(format string, args ...any) {
	c.problems = append(c.problems, fmt.Sprintf(format, args...))
}

type rect struct {
	title      string
	x, y, w, h uint32
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: monitoring-check DASHBOARD.json...")
		os.Exit(2)
	}
	plugins.RegisterDefaultPlugins()
	failed := false
	for _, path := range os.Args[1:] {
		c := &check{file: filepath.Base(path), metrics: map[string]bool{}}
		switch filepath.Ext(path) {
		case ".yaml", ".yml":
			c.rules(path)
		default:
			c.dashboard(path)
		}
		for _, p := range c.problems {
			fmt.Printf("ERROR %s: %s\n", c.file, p)
			failed = true
		}
		names := make([]string, 0, len(c.metrics))
		for m := range c.metrics {
			names = append(names, m)
		}
		sort.Strings(names)
		for _, m := range names {
			fmt.Printf("METRIC %s %s\n", c.file, m)
		}
	}
	if failed {
		os.Exit(1)
	}
	fmt.Printf("OK %d\n", len(os.Args)-1)
}

// rules records the metric names a rule file's expressions read.
func (c *check) rules(path string) {
	groups, errs := rulefmt.ParseFile(path, false, model.UTF8Validation, promql, promslog.NewNopLogger())
	for _, err := range errs {
		c.fail("%v", err)
	}
	if groups == nil {
		return
	}
	for _, g := range groups.Groups {
		for _, r := range g.Rules {
			c.expr(fmt.Sprintf("rule %s%s", r.Alert, r.Record), r.Expr)
		}
	}
}

// expr parses a PromQL expression and records the metric names it reads.
func (c *check) expr(where, text string) {
	expr, err := promql.ParseExpr(grafanaVars.Replace(text))
	if err != nil {
		c.fail("%s: %v", where, err)
		return
	}
	parser.Inspect(expr, func(node parser.Node, _ []parser.Node) error {
		if vs, ok := node.(*parser.VectorSelector); ok && vs.Name != "" {
			c.metrics[vs.Name] = true
		}
		return nil
	})
}

func (c *check) dashboard(path string) {
	raw, err := os.ReadFile(path)
	if err != nil {
		c.fail("%v", err)
		return
	}
	var d dashboard.Dashboard
	// The SDK returns its error list as an `error` even when the list is empty (a nil slice
	// in a non-nil interface): only a non-empty message is a problem.
	if err := d.UnmarshalJSONStrict(raw); err != nil && err.Error() != "" {
		c.fail("not a Grafana dashboard: %v", err)
		return
	}
	if err := d.Validate(); err != nil && err.Error() != "" {
		c.fail("invalid: %v", err)
	}
	if d.Uid == nil || *d.Uid == "" || d.Title == nil || *d.Title == "" {
		c.fail("a dashboard needs a uid and a title")
	}
	hasVar := false
	for _, v := range d.Templating.List {
		if v.Name == "datasource" && v.Type == "datasource" {
			hasVar = true
		}
	}
	if !hasVar {
		c.fail("no `datasource` variable of type datasource")
	}
	ids := map[uint32]string{}
	var placed []rect
	seen := func(id *uint32, title string) {
		if id == nil {
			c.fail("panel %q has no id", title)
			return
		}
		if other, dup := ids[*id]; dup {
			c.fail("panels %q and %q share id %d", other, title, *id)
		}
		ids[*id] = title
	}
	place := func(g *dashboard.GridPos, title string) {
		if g == nil {
			c.fail("panel %q has no gridPos", title)
			return
		}
		r := rect{title, g.X, g.Y, g.W, g.H}
		if r.w == 0 || r.h == 0 || r.x+r.w > 24 {
			c.fail("panel %q is not on the 24-column grid: %+v", title, *g)
		}
		for _, o := range placed {
			if r.x < o.x+o.w && o.x < r.x+r.w && r.y < o.y+o.h && o.y < r.y+r.h {
				c.fail("panels %q and %q overlap", o.title, title)
			}
		}
		placed = append(placed, r)
	}
	// Each panel decoded on its own: the SDK's strict decoding of `panels` checks them but
	// keeps none (a nil error list returned as a non-nil `error` reads as a failure there).
	var top struct {
		Panels []json.RawMessage `json:"panels"`
	}
	if err := json.Unmarshal(raw, &top); err != nil {
		c.fail("%v", err)
		return
	}
	panels := 0
	for i, rawPanel := range top.Panels {
		var kind struct {
			Type string `json:"type"`
		}
		if err := json.Unmarshal(rawPanel, &kind); err != nil {
			c.fail("panels[%d]: %v", i, err)
			continue
		}
		if kind.Type == "row" {
			var row dashboard.RowPanel
			if err := row.UnmarshalJSONStrict(rawPanel); err != nil && err.Error() != "" {
				c.fail("panels[%d]: %v", i, err)
				continue
			}
			title := deref(row.Title)
			id := row.Id
			seen(&id, title)
			place(row.GridPos, title)
			if len(row.Panels) > 0 {
				c.fail("row %q: nest no panels in rows (collapsed rows hide them from this check)", title)
			}
			continue
		}
		var p dashboard.Panel
		if err := p.UnmarshalJSONStrict(rawPanel); err != nil && err.Error() != "" {
			c.fail("panels[%d]: %v", i, err)
			continue
		}
		c.panel(&p, rawPanel, seen, place)
		panels++
	}
	if panels == 0 {
		c.fail("no panels")
	}
}

func (c *check) panel(p *dashboard.Panel, raw json.RawMessage, seen func(*uint32, string), place func(*dashboard.GridPos, string)) {
	title := deref(p.Title)
	if title == "" {
		c.fail("a %s panel has no title", p.Type)
	}
	if deref(p.Description) == "" {
		c.fail("panel %q has no description", title)
	}
	seen(p.Id, title)
	place(p.GridPos, title)
	// The queries decoded here for the same reason as the panels (the SDK keeps none).
	var targets struct {
		Targets []json.RawMessage `json:"targets"`
	}
	if err := json.Unmarshal(raw, &targets); err != nil {
		c.fail("panel %q: %v", title, err)
		return
	}
	if len(targets.Targets) == 0 {
		c.fail("panel %q has no query", title)
	}
	for i, t := range targets.Targets {
		q := &prometheus.Dataquery{}
		if err := q.UnmarshalJSONStrict(t); err != nil && err.Error() != "" {
			c.fail("panel %q: targets[%d] is not a Prometheus query: %v", title, i, err)
			continue
		}
		if q.Datasource == nil || q.Datasource.Uid == nil || *q.Datasource.Uid != "${datasource}" {
			c.fail("panel %q: query %s does not use the ${datasource} variable", title, q.RefId)
		}
		c.expr(fmt.Sprintf("panel %q: query %s", title, q.RefId), q.Expr)
	}
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}
