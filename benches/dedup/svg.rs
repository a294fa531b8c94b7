//! The plots: `bench.svg` (calls per second by variant and tasks) and `batch.svg` (the
//! batch curve), plain SVG written by hand.

use std::fmt::Write as _;

use crate::config::{BackendName, Config, TASKS, Variant};
use crate::report::{Summary, thousands};
use crate::timing::PAIRS;

/// Grouped bars, one panel per backend: calls per second by tasks and variant, with
/// the three call-by-call ratios written under each group.
pub(crate) fn svg(summary: &Summary, config: &Config, backends: &[BackendName]) -> String {
    const PANEL_W: f64 = 560.0;
    const PANEL_H: f64 = 300.0;
    const LEFT: f64 = 70.0;
    const TOP: f64 = 70.0;
    const COLORS: [&str; 6] = [
        "#1f77b4", "#aec7e8", "#7f7f7f", "#2ca02c", "#ff7f0e", "#9467bd",
    ];
    let width = LEFT + PANEL_W * backends.len() as f64 + 20.0;
    let height = TOP + PANEL_H + 90.0;
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" \
         viewBox=\"0 0 {width} {height}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{LEFT}\" y=\"24\" font-size=\"16\" font-weight=\"bold\">dedup: calls per second \
         (median of {} rounds of {} calls; higher is better)</text>\n\
         <text x=\"{LEFT}\" y=\"44\" fill=\"#555\">under each group, timed call by call: \
         generated / hand-written · duplicate / processing · 10M rows / empty \
         (10M rows: a dedup table of {} ids)</text>\n",
        config.rounds,
        config.ops,
        thousands(config.big_rows)
    );
    for (index, &backend) in backends.iter().enumerate() {
        let x0 = LEFT + PANEL_W * index as f64;
        let variants: Vec<Variant> = Variant::ALL
            .into_iter()
            .filter(|&v| {
                TASKS
                    .iter()
                    .any(|&t| summary.rate.contains_key(&(backend, t, v)))
            })
            .collect();
        let top = TASKS
            .iter()
            .flat_map(|&t| {
                variants
                    .iter()
                    .filter_map(move |&v| summary.rate.get(&(backend, t, v)))
            })
            .fold(1.0_f64, |a, &b| a.max(b));
        // A round axis maximum: 1, 2 or 5 times a power of ten.
        let magnitude = 10f64.powf(top.log10().floor());
        let axis_max = [1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0]
            .iter()
            .map(|m| m * magnitude)
            .find(|&m| m >= top)
            .unwrap_or(top);
        let plot_w = PANEL_W - 40.0;
        let y = |value: f64| TOP + PANEL_H - value / axis_max * PANEL_H;
        let _ = writeln!(
            out,
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"14\" font-weight=\"bold\">{}</text>",
            x0,
            TOP - 8.0,
            backend.name()
        );
        for step in 0..=5 {
            let value = axis_max * f64::from(step) / 5.0;
            let (line_y, label_x) = (y(value), x0 - 4.0);
            let _ = writeln!(
                out,
                "<line x1=\"{x0:.1}\" x2=\"{x1:.1}\" y1=\"{line_y:.1}\" y2=\"{line_y:.1}\" \
                 stroke=\"#ddd\"/><text x=\"{label_x:.1}\" y=\"{label_y:.1}\" \
                 text-anchor=\"end\" fill=\"#555\">{label}</text>",
                x1 = x0 + plot_w,
                label_y = line_y + 4.0,
                label = value.round()
            );
        }
        let group_w = plot_w / TASKS.len() as f64;
        let bar_w = (group_w - 20.0) / variants.len().max(1) as f64;
        for (g, &tasks) in TASKS.iter().enumerate() {
            let gx = x0 + group_w * g as f64 + 10.0;
            for (b, &variant) in variants.iter().enumerate() {
                let Some(&rate) = summary.rate.get(&(backend, tasks, variant)) else {
                    continue;
                };
                let color = COLORS[Variant::ALL.iter().position(|&v| v == variant).unwrap_or(0)];
                let _ = writeln!(
                    out,
                    "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{color}\">\
                     <title>{} {} tasks: {rate:.0}/s</title></rect>",
                    gx + bar_w * b as f64,
                    y(rate),
                    bar_w - 2.0,
                    TOP + PANEL_H - y(rate),
                    variant.name(),
                    tasks
                );
            }
            let _ = writeln!(
                out,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{tasks} task{}</text>",
                gx + (group_w - 20.0) / 2.0,
                TOP + PANEL_H + 18.0,
                if tasks == 1 { "" } else { "s" }
            );
            let ratios: Vec<String> = (0..PAIRS.len())
                .map(|pair| {
                    summary
                        .pair_ratio
                        .get(&(backend, tasks, pair))
                        // Three decimals where the question is "1.00 or not".
                        .map_or_else(
                            || "-".to_owned(),
                            |ratio| {
                                if pair == 0 {
                                    format!("{ratio:.3}×")
                                } else {
                                    format!("{ratio:.2}×")
                                }
                            },
                        )
                })
                .collect();
            let _ = writeln!(
                out,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#333\">{}</text>",
                gx + (group_w - 20.0) / 2.0,
                TOP + PANEL_H + 34.0,
                ratios.join(" · ")
            );
        }
    }
    // Legend.
    let mut lx = LEFT;
    let ly = TOP + PANEL_H + 60.0;
    for (variant, color) in Variant::ALL.iter().zip(COLORS) {
        let _ = writeln!(
            out,
            "<rect x=\"{lx:.1}\" y=\"{:.1}\" width=\"12\" height=\"12\" fill=\"{color}\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
            ly - 10.0,
            lx + 16.0,
            ly,
            variant.name()
        );
        lx += 30.0 + 7.0 * variant.name().len() as f64;
    }
    out.push_str("</svg>\n");
    out
}

/// The batch curve: messages per second (log scale) against the batch size, one line per
/// backend and task count, the single-message generated handler first.
pub(crate) fn batch_svg(series: &[(String, Vec<f64>)]) -> String {
    const COLORS: [&str; 4] = ["#1f77b4", "#aec7e8", "#2ca02c", "#98df8a"];
    let labels = ["single", "1", "10", "100", "1,000"];
    let (left, top, width, height) = (70.0, 50.0, 560.0, 300.0);
    let values = series.iter().flat_map(|(_, rates)| rates.iter().copied());
    let (low, high) = values.fold((f64::MAX, 1.0_f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let (low, high) = (
        10f64.powf(low.max(1.0).log10().floor()),
        10f64.powf(high.log10().ceil()),
    );
    let x = |k: usize| left + width * k as f64 / (labels.len() - 1) as f64;
    let y =
        |v: f64| top + height - (v.log10() - low.log10()) / (high.log10() - low.log10()) * height;
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" \
         viewBox=\"0 0 {w} {h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{left}\" y=\"24\" font-size=\"16\" font-weight=\"bold\">dedup batches: \
         messages per second by batch size (log scale; median of the rounds)</text>\n",
        w = left + width + 190.0,
        h = top + height + 50.0,
    );
    let mut decade = low;
    while decade <= high * 1.001 {
        let line_y = y(decade);
        let _ = writeln!(
            out,
            "<line x1=\"{left}\" x2=\"{:.1}\" y1=\"{line_y:.1}\" y2=\"{line_y:.1}\" stroke=\"#ddd\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\" fill=\"#555\">{}</text>",
            left + width,
            left - 4.0,
            line_y + 4.0,
            thousands(decade as i64)
        );
        decade *= 10.0;
    }
    for (k, label) in labels.iter().enumerate() {
        let _ = writeln!(
            out,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{label}</text>",
            x(k),
            top + height + 20.0
        );
    }
    for (n, (name, rates)) in series.iter().enumerate() {
        let color = COLORS[n % COLORS.len()];
        let points: Vec<String> = rates
            .iter()
            .enumerate()
            .map(|(k, rate)| format!("{:.1},{:.1}", x(k), y(*rate)))
            .collect();
        let _ = writeln!(
            out,
            "<polyline points=\"{}\" fill=\"none\" stroke=\"{color}\" stroke-width=\"2\"/>",
            points.join(" ")
        );
        for (k, rate) in rates.iter().enumerate() {
            let _ = writeln!(
                out,
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{color}\"><title>{name}, {}: {rate:.0}/s</title></circle>",
                x(k),
                y(*rate),
                labels[k]
            );
        }
        let ly = top + 16.0 * n as f64;
        let _ = writeln!(
            out,
            "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"12\" height=\"12\" fill=\"{color}\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\">{name}</text>",
            left + width + 20.0,
            ly - 10.0,
            left + width + 36.0,
            ly
        );
    }
    out.push_str("</svg>\n");
    out
}
