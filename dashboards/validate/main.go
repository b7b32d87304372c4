// Command validate checks Grafana dashboard JSON files the way gpuguard ships them:
//
//  1. a strict unmarshal with grafana-foundation-sdk's Go types (unknown keys and wrong types are
//     errors, panel options and Prometheus queries included, through the SDK's registered
//     plugins), then the SDK's Validate() (out-of-range values). Neither catches a bad enum
//     value or a missing title: tests/test_dashboard.py checks those;
//  2. every Prometheus query (panel targets, and the selector of each label_values() variable)
//     parsed by Prometheus's own PromQL parser, with Grafana's variables substituted.
//
// Usage: validate [-queries] FILE...
//
//	exit 0: every file passed; 1: one failed (errors on stderr); 2: usage.
//	-queries: print each query as a JSON line {"panel", "title", "expr", "metrics"} (the metric
//	names its selectors read), for the tests to check against the exported names.
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"regexp"
	"sort"

	"github.com/grafana/grafana-foundation-sdk/go/cog"
	"github.com/grafana/grafana-foundation-sdk/go/cog/plugins"
	"github.com/grafana/grafana-foundation-sdk/go/dashboard"
	"github.com/grafana/grafana-foundation-sdk/go/prometheus"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
)

// Query is one PromQL expression of a dashboard, as -queries prints it.
type Query struct {
	Panel   uint32   `json:"panel"`
	Title   string   `json:"title"`
	Expr    string   `json:"expr"`
	Metrics []string `json:"metrics"`
}

// orNil undoes a typed nil: SDK v0.0.22's generated UnmarshalJSONStrict methods end with
// `return errs` even for an empty cog.BuildErrors, a non-nil error interface holding no errors.
func orNil(err error) error {
	var errs cog.BuildErrors
	if errors.As(err, &errs) && len(errs) == 0 {
		return nil
	}
	return err
}

var (
	// Grafana's interval variables become a duration, so a range selector still parses.
	intervalVar = regexp.MustCompile(`\$(__rate_interval|__interval|__range)\b|\$\{(__rate_interval|__interval|__range)\}`)
	// Any other variable ($hostname, ${namespace}) only ever stands inside a quoted matcher.
	otherVar    = regexp.MustCompile(`\$\{?[A-Za-z_][A-Za-z0-9_]*\}?`)
	labelValues = regexp.MustCompile(`^\s*label_values\((.*),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*$`)
)

func substitute(expr string) string {
	return otherVar.ReplaceAllString(intervalVar.ReplaceAllString(expr, "5m"), "x")
}

// metrics parses expr and returns the metric names its selectors read.
func metrics(p parser.Parser, expr string) ([]string, error) {
	ast, err := p.ParseExpr(substitute(expr))
	if err != nil {
		return nil, err
	}
	seen := map[string]bool{}
	parser.Inspect(ast, func(node parser.Node, _ []parser.Node) error {
		if vs, ok := node.(*parser.VectorSelector); ok {
			name := vs.Name
			for _, m := range vs.LabelMatchers {
				if m.Name == labels.MetricName && m.Type == labels.MatchEqual {
					name = m.Value
				}
			}
			if name == "" {
				name = vs.String() // no single name: the tests reject it
			}
			seen[name] = true
		}
		return nil
	})
	names := make([]string, 0, len(seen))
	for n := range seen {
		names = append(names, n)
	}
	sort.Strings(names)
	return names, nil
}

func check(path string, p parser.Parser) ([]Query, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var d dashboard.Dashboard
	if err := orNil(d.UnmarshalJSONStrict(raw)); err != nil {
		return nil, fmt.Errorf("strict unmarshal: %w", err)
	}
	if err := orNil(d.Validate()); err != nil {
		return nil, fmt.Errorf("validate: %w", err)
	}
	// SDK v0.0.22's generated strict unmarshallers end with `return errs` even when errs is an
	// empty cog.BuildErrors (a typed nil, so a non-nil error): its callers then drop the panel
	// or the query that decoded fine, and d.Validate() never sees them. The errors themselves
	// are still reported, so decode (and validate) each panel and each query again, on its own.
	var queries []Query
	var errs []error
	add := func(panel uint32, title, expr string) {
		names, err := metrics(p, expr)
		if err != nil {
			errs = append(errs, fmt.Errorf("%q: PromQL %q: %w", title, expr, err))
			return
		}
		queries = append(queries, Query{Panel: panel, Title: title, Expr: expr, Metrics: names})
	}
	var top struct {
		Panels []json.RawMessage `json:"panels"`
	}
	if err := json.Unmarshal(raw, &top); err != nil {
		return nil, err
	}
	for i, rawPanel := range top.Panels {
		var kind struct {
			Type   string            `json:"type"`
			Panels []json.RawMessage `json:"panels"`
		}
		if err := json.Unmarshal(rawPanel, &kind); err != nil {
			return nil, fmt.Errorf("panels[%d]: %w", i, err)
		}
		inner := []json.RawMessage{rawPanel}
		if kind.Type == "row" {
			var row dashboard.RowPanel
			if err := orNil(row.UnmarshalJSONStrict(rawPanel)); err != nil {
				return nil, fmt.Errorf("panels[%d]: %w", i, err)
			}
			if err := orNil(row.Validate()); err != nil {
				return nil, fmt.Errorf("panels[%d]: %w", i, err)
			}
			inner = kind.Panels
		}
		for _, r := range inner {
			var panel dashboard.Panel
			if err := orNil(panel.UnmarshalJSONStrict(r)); err != nil {
				return nil, fmt.Errorf("panels[%d]: %w", i, err)
			}
			if err := orNil(panel.Validate()); err != nil {
				return nil, fmt.Errorf("panels[%d]: %w", i, err)
			}
			var targets struct {
				Targets []json.RawMessage `json:"targets"`
			}
			if err := json.Unmarshal(r, &targets); err != nil {
				return nil, fmt.Errorf("panels[%d]: %w", i, err)
			}
			title, id := "", uint32(0)
			if panel.Title != nil {
				title = *panel.Title
			}
			if panel.Id != nil {
				id = *panel.Id
			}
			for j, rawTarget := range targets.Targets {
				var q prometheus.Dataquery
				if err := orNil(q.UnmarshalJSONStrict(rawTarget)); err != nil {
					errs = append(errs, fmt.Errorf("%q: targets[%d]: %w", title, j, err))
					continue
				}
				if err := orNil(q.Validate()); err != nil {
					errs = append(errs, fmt.Errorf("%q: targets[%d]: %w", title, j, err))
					continue
				}
				add(id, title, q.Expr)
			}
		}
	}
	for _, v := range d.Templating.List {
		if v.Type != "query" || v.Query == nil || v.Query.String == nil {
			continue
		}
		m := labelValues.FindStringSubmatch(*v.Query.String)
		if m == nil {
			errs = append(errs, fmt.Errorf("variable %s: not label_values(SELECTOR, LABEL): %q", v.Name, *v.Query.String))
			continue
		}
		add(0, "$"+v.Name, m[1])
	}
	return queries, errors.Join(errs...)
}

func main() {
	printQueries := flag.Bool("queries", false, "print each query and its metric names as JSON lines")
	flag.Parse()
	if flag.NArg() == 0 {
		fmt.Fprintln(os.Stderr, "usage: validate [-queries] FILE...")
		os.Exit(2)
	}
	// Without the plugins, panel options and queries would be decoded as untyped maps.
	plugins.RegisterDefaultPlugins()
	p := parser.NewParser(parser.Options{})
	failed := false
	out := json.NewEncoder(os.Stdout)
	for _, path := range flag.Args() {
		queries, err := check(path, p)
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", path, err)
			failed = true
			continue
		}
		if *printQueries {
			for _, q := range queries {
				if err := out.Encode(q); err != nil {
					fmt.Fprintln(os.Stderr, err)
					os.Exit(1)
				}
			}
		} else {
			fmt.Printf("%s: ok (%d queries parsed)\n", path, len(queries))
		}
	}
	if failed {
		os.Exit(1)
	}
}
