// Command promql-check parses PromQL expressions with Prometheus's own parser
// (github.com/prometheus/prometheus/promql/parser), so the dashboard test
// checks queries exactly as the Prometheus server would.
//
// Input (stdin): a JSON array of expressions, already interpolated the way
// Grafana would before sending them (no $variables left).
// Output (stdout): a JSON array, one object per expression, in order:
//
//	{"expr": ..., "error": "" or the parser's message,
//	 "selectors": [{"metric": name, "matchers": [{"name", "type", "value"}]}],
//	 "groupings": [{"by": [labels], "metrics": [names aggregated]}]}
//
// The selectors come from walking the parsed AST's vector selectors (metric
// name plus label matchers, the name matcher left out), so the test learns
// which series a query reads without a regular expression of its own.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"

	"github.com/prometheus/prometheus/promql/parser"
)

type matcher struct {
	Name  string `json:"name"`
	Type  string `json:"type"` // =, !=, =~ or !~
	Value string `json:"value"`
}

type selector struct {
	Metric   string    `json:"metric"`
	Matchers []matcher `json:"matchers"`
}

// grouping is one aggregation's `by (...)` labels and the metrics it aggregates.
type grouping struct {
	By      []string `json:"by"`
	Metrics []string `json:"metrics"`
}

type result struct {
	Expr      string     `json:"expr"`
	Error     string     `json:"error"`
	Selectors []selector `json:"selectors"`
	Groupings []grouping `json:"groupings"`
}

// metricsUnder lists the metric names selected anywhere below node.
func metricsUnder(node parser.Node) []string {
	names := []string{}
	parser.Inspect(node, func(n parser.Node, _ []parser.Node) error {
		if vs, ok := n.(*parser.VectorSelector); ok && vs.Name != "" {
			names = append(names, vs.Name)
		}
		return nil
	})
	sort.Strings(names)
	return names
}

// The zero Options are a Prometheus server's defaults: no experimental
// functions, so a query that needs a feature flag fails here too.
var promql = parser.NewParser(parser.Options{})

func check(expr string) result {
	r := result{Expr: expr, Selectors: []selector{}, Groupings: []grouping{}}
	ast, err := promql.ParseExpr(expr)
	if err != nil {
		r.Error = err.Error()
		return r
	}
	parser.Inspect(ast, func(node parser.Node, _ []parser.Node) error {
		if agg, ok := node.(*parser.AggregateExpr); ok && !agg.Without && len(agg.Grouping) > 0 {
			r.Groupings = append(r.Groupings, grouping{By: agg.Grouping, Metrics: metricsUnder(agg.Expr)})
		}
		vs, ok := node.(*parser.VectorSelector)
		if !ok {
			return nil
		}
		sel := selector{Metric: vs.Name, Matchers: []matcher{}}
		for _, m := range vs.LabelMatchers {
			if m.Name == "__name__" {
				continue
			}
			sel.Matchers = append(sel.Matchers, matcher{Name: m.Name, Type: m.Type.String(), Value: m.Value})
		}
		sort.Slice(sel.Matchers, func(i, j int) bool { return sel.Matchers[i].Name < sel.Matchers[j].Name })
		r.Selectors = append(r.Selectors, sel)
		return nil
	})
	return r
}

func main() {
	var exprs []string
	if err := json.NewDecoder(os.Stdin).Decode(&exprs); err != nil {
		fmt.Fprintln(os.Stderr, "promql-check: stdin must be a JSON array of strings:", err)
		os.Exit(2)
	}
	out := make([]result, 0, len(exprs))
	for _, e := range exprs {
		out = append(out, check(e))
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, "promql-check:", err)
		os.Exit(1)
	}
}
