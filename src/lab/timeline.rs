//! The timeline picture: activities as bars on a time axis, one row per
//! nesting level (overlapping bars of one level get extra lanes), drawn as a
//! hand-written SVG, and a self-contained HTML page around it with a hover
//! tooltip and the activity table.

use super::analysis::ActivityStats;
use super::report::num;
use std::fmt::Write;

/// Drawing area width, px.
const WIDTH: f64 = 1360.0;
/// Left/right margin, px.
const MARGIN: f64 = 20.0;
/// Height of one lane, px.
const LANE: f64 = 26.0;
/// Space for the title and the axis labels, px.
const TOP: f64 = 50.0;
/// Narrowest bar drawn, px (so a 10 µs initcall is still hoverable).
const MIN_BAR: f64 = 1.0;
/// A bar must be this wide to carry its name, px per character.
const PX_PER_CHAR: f64 = 6.2;
/// Bar colours by nesting level.
const COLOURS: [&str; 5] = ["#8da0cb", "#66c2a5", "#fc8d62", "#e78ac3", "#a6d854"];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Assigns each activity a lane: its level's first lane where it does not
/// overlap the bar before it. Returns (lane per activity, lane count).
fn lanes(acts: &[ActivityStats]) -> (Vec<usize>, usize) {
    let max_depth = acts.iter().map(|a| a.depth).max().unwrap_or(0);
    // Per depth: the end time of the last bar in each of its lanes.
    let mut ends: Vec<Vec<f64>> = vec![Vec::new(); max_depth + 1];
    let mut local = Vec::with_capacity(acts.len());
    for a in acts {
        let (start, end) = (a.start_ms.mean, a.start_ms.mean + a.duration_ms.mean);
        let level = &mut ends[a.depth];
        let lane = match level.iter().position(|&e| e <= start + 1e-9) {
            Some(l) => l,
            None => {
                level.push(0.0);
                level.len() - 1
            }
        };
        level[lane] = end;
        local.push((a.depth, lane));
    }
    let mut first = vec![0; max_depth + 2];
    for d in 0..=max_depth {
        first[d + 1] = first[d] + ends[d].len().max(1);
    }
    let assigned = local.iter().map(|(d, l)| first[*d] + l).collect();
    (assigned, first[max_depth + 1])
}

/// A round step for about ten axis ticks over `total` ms.
fn tick_step(total: f64) -> f64 {
    let raw = (total / 10.0).max(1e-3);
    let mag = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag)
}

/// The tooltip text of one bar.
fn describe(a: &ActivityStats) -> String {
    format!(
        "{}\nstart {} ms\nduration {} ms ± {} ms (min {} – max {})\n{:.1}% of the run, {} boot(s), {} clock",
        a.name,
        num(a.start_ms.mean),
        num(a.duration_ms.mean),
        num(a.duration_ms.sd),
        num(a.duration_ms.min),
        num(a.duration_ms.max),
        a.pct_of_total,
        a.duration_ms.n,
        format!("{:?}", a.clock).to_lowercase()
    )
}

/// Renders the timeline as SVG. `total_ms` is the axis length; `title` goes on top.
pub fn svg(acts: &[ActivityStats], total_ms: f64, title: &str) -> String {
    let total = if total_ms > 0.0 { total_ms } else { 1.0 };
    let (lane_of, lane_count) = lanes(acts);
    let height = TOP + lane_count as f64 * LANE + 30.0;
    let width = WIDTH + 2.0 * MARGIN;
    let x = |ms: f64| MARGIN + (ms / total).clamp(0.0, 1.0) * WIDTH;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(s, r##"<rect width="100%" height="100%" fill="#ffffff"/>"##);
    let _ = writeln!(
        s,
        r#"<text x="{MARGIN}" y="18" font-size="14" font-weight="bold">{}</text>"#,
        esc(title)
    );
    let step = tick_step(total);
    let axis_bottom = TOP + lane_count as f64 * LANE;
    let mut t = 0.0;
    while t <= total + 1e-9 {
        let _ = writeln!(
            s,
            r##"<line x1="{0:.1}" y1="{1}" x2="{0:.1}" y2="{axis_bottom}" stroke="#dddddd"/><text x="{0:.1}" y="{2}" text-anchor="middle" fill="#555">{3} ms</text>"##,
            x(t),
            TOP - 6.0,
            TOP - 10.0,
            // Round steps print without trailing zeros (0.5, 10, 2000).
            (t * 1e3).round() / 1e3
        );
        t += step;
    }
    for (a, lane) in acts.iter().zip(&lane_of) {
        let (x0, x1) = (x(a.start_ms.mean), x(a.start_ms.mean + a.duration_ms.mean));
        let w = (x1 - x0).max(MIN_BAR);
        let y = TOP + *lane as f64 * LANE + 2.0;
        let colour = COLOURS[a.depth % COLOURS.len()];
        let _ = write!(
            s,
            r##"<g class="bar"><title>{}</title><rect x="{x0:.2}" y="{y}" width="{w:.2}" height="{}" fill="{colour}" stroke="#333" stroke-width="0.4" data-name="{}"/>"##,
            esc(&describe(a)),
            LANE - 4.0,
            esc(&a.name)
        );
        // The full label, else the name, else its last part (`crypto_algapi_init`).
        let short = a.name.rsplit(':').next().unwrap_or(&a.name).to_owned();
        let label = [
            format!("{} {}ms", a.name, num(a.duration_ms.mean)),
            a.name.clone(),
            short,
        ]
        .into_iter()
        .find(|l| w > l.chars().count() as f64 * PX_PER_CHAR);
        if let Some(label) = label {
            let _ = write!(
                s,
                r#"<text x="{:.2}" y="{:.1}" pointer-events="none">{}</text>"#,
                x0 + 3.0,
                y + LANE / 2.0 + 2.0,
                esc(&label)
            );
        }
        s.push_str("</g>\n");
    }
    let _ = writeln!(
        s,
        r##"<text x="{MARGIN}" y="{:.0}" fill="#555">one row per nesting level; bar = mean start and mean duration over the boots; hover for figures</text>"##,
        axis_bottom + 20.0
    );
    s.push_str("</svg>\n");
    s
}

/// A self-contained HTML page: the SVG, a tooltip that follows the mouse,
/// and the activity table.
pub fn html(
    acts: &[ActivityStats],
    total_ms: f64,
    title: &str,
    report_text: &str,
    advice: &[super::doctor::Advice],
) -> String {
    let mut rows = String::new();
    // The doctor's advice, beside the chart.
    let mut side = String::new();
    if !advice.is_empty() {
        side.push_str("<div id=\"advice\"><h3>Advice</h3><ol>");
        for a in advice {
            let _ = write!(
                side,
                "<li><b>{}</b><br>predicted −{:.1} ms{}<br><code>{}</code><ul>",
                esc(&a.title),
                a.predicted_ms,
                a.verified.as_ref().map_or(String::new(), |v| format!(
                    "<br>verified: {}",
                    esc(&super::doctor::verification_text(v))
                )),
                esc(&a.change.describe())
            );
            for e in &a.evidence {
                let _ = write!(side, "<li>{}</li>", esc(e));
            }
            side.push_str("</ul></li>");
        }
        side.push_str("</ol></div>");
    }
    for a in acts {
        let _ = writeln!(
            rows,
            "<tr><td style=\"padding-left:{}em\">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.1}%</td><td>{:?}</td><td>{}</td></tr>",
            a.depth,
            esc(&a.name),
            num(a.start_ms.mean),
            num(a.duration_ms.mean),
            num(a.duration_ms.sd),
            a.pct_of_total,
            a.clock,
            a.duration_ms.n
        );
    }
    format!(
        r#"<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 16px; color: #222; }}
#main {{ display: flex; gap: 12px; align-items: flex-start; }}
#chart {{ border: 1px solid #ccc; flex: 3; }}
#advice {{ flex: 2; font-size: 12px; max-height: 90vh; overflow-y: auto; }}
#advice ul {{ color: #555; padding-left: 16px; }}
#chart svg {{ width: 100%; height: auto; }}
.bar rect:hover {{ stroke: #000; stroke-width: 2; }}
#tip {{ position: fixed; display: none; background: #fffbe6; border: 1px solid #999;
        padding: 6px 8px; font-size: 12px; white-space: pre; pointer-events: none; }}
table {{ border-collapse: collapse; font-size: 12px; margin-top: 12px; }}
td, th {{ border-bottom: 1px solid #eee; padding: 2px 8px; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
pre {{ font-size: 12px; background: #f6f6f6; padding: 8px; }}
</style></head><body>
<div id="main"><div id="chart">{svg}</div>{side}</div>
<div id="tip"></div>
<details><summary>Report</summary><pre>{report}</pre></details>
<table><tr><th>activity</th><th>start ms</th><th>mean ms</th><th>sd ms</th><th>% run</th><th>clock</th><th>n</th></tr>
{rows}</table>
<script>
const tip = document.getElementById('tip');
for (const g of document.querySelectorAll('.bar')) {{
  const text = g.querySelector('title').textContent;
  g.addEventListener('mousemove', e => {{
    tip.textContent = text; tip.style.display = 'block';
    // Keep the tooltip on screen: flip it to the left of the pointer near the right edge.
    const x = e.clientX + 12 + tip.offsetWidth > window.innerWidth ? e.clientX - 12 - tip.offsetWidth : e.clientX + 12;
    tip.style.left = Math.max(0, x) + 'px'; tip.style.top = (e.clientY + 12) + 'px';
  }});
  g.addEventListener('mouseleave', () => {{ tip.style.display = 'none'; }});
}}
</script>
</body></html>
"#,
        title = esc(title),
        svg = svg(acts, total_ms, title),
        report = esc(report_text),
        side = side,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::analysis::Clock;
    use crate::lab::stats::Summary;

    fn act(name: &str, depth: usize, start: f64, len: f64) -> ActivityStats {
        ActivityStats {
            name: name.into(),
            parent: None,
            depth,
            start_ms: Summary::of(&[start]).unwrap(),
            duration_ms: Summary::of(&[len]).unwrap(),
            pct_of_total: len,
            clock: Clock::Guest,
        }
    }

    #[test]
    fn overlapping_bars_of_one_level_get_their_own_lane() {
        let acts = [
            act("run", 0, 0.0, 100.0),
            act("a", 1, 0.0, 50.0),
            act("b", 1, 40.0, 20.0),
            act("c", 1, 60.0, 10.0),
            act("x", 2, 5.0, 1.0),
        ];
        let (l, n) = lanes(&acts);
        assert_eq!(l, [0, 1, 2, 1, 3]);
        assert_eq!(n, 4);
    }

    #[test]
    fn svg_has_a_bar_and_tooltip_per_activity_and_escapes_names() {
        let acts = [act("run", 0, 0.0, 100.0), act("a<b>", 1, 10.0, 50.0)];
        let s = svg(&acts, 100.0, "t & t");
        assert_eq!(s.matches("<rect x=").count(), 2);
        assert_eq!(s.matches("<title>").count(), 2);
        assert!(s.contains("a&lt;b&gt;") && !s.contains("a<b>"));
        assert!(s.contains("t &amp; t"));
        assert!(s.contains(">50 ms<"), "axis ticks every 10 ms");
        let h = html(&acts, 100.0, "t", "report", &[]);
        assert!(h.starts_with("<!DOCTYPE html>") && h.contains("<svg") && h.contains("mousemove"));
        assert!(!h.contains("id=\"advice\""));
        let advice = [crate::lab::doctor::Advice {
            id: "quiet".into(),
            title: "Quiet <please>".into(),
            evidence: vec!["900 lines".into()],
            predicted_ms: 12.5,
            change: crate::lab::doctor::Change::CmdlineAdd {
                option: "quiet".into(),
            },
            verified: None,
        }];
        let h = html(&acts, 100.0, "t", "report", &advice);
        assert!(h.contains("id=\"advice\"") && h.contains("Quiet &lt;please&gt;"));
        assert!(h.contains("predicted −12.5 ms") && h.contains("<li>900 lines</li>"));
    }

    #[test]
    fn ticks_are_round() {
        assert_eq!(tick_step(2131.0), 500.0);
        assert_eq!(tick_step(100.0), 10.0);
        assert_eq!(tick_step(7.0), 1.0);
    }
}
