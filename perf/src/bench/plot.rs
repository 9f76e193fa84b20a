//! PNG plots (plotters, bitmap backend). Text needs a TrueType font loaded at run time; without
//! one the plots are drawn without any text instead of failing.

use std::ops::Sub;
use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::prelude::*;

use super::peers::PeerKind;
use super::{Cell, Results, Scenario, thousands};

/// Default font (Debian package fonts-dejavu-core).
pub const DEFAULT_FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// Registers the TrueType font at `path` as "sans-serif"; false if missing or unusable.
pub fn load_font(path: &Path) -> bool {
    let Ok(bytes) = std::fs::read(path) else {
        return false;
    };
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
}

fn color(p: PeerKind) -> RGBColor {
    match p {
        PeerKind::Direct => RGBColor(110, 110, 110),
        PeerKind::Spur => RGBColor(31, 100, 200),
        PeerKind::SpurKeyed => RGBColor(120, 175, 240),
        PeerKind::Nginx => RGBColor(40, 150, 60),
        PeerKind::Haproxy => RGBColor(230, 120, 20),
    }
}

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("plot: {e:?}")
}

/// x position of quantile `q` on the "nines" axis: −log10(1 − q).
fn nines(q: f64) -> f64 {
    -(1.0 - q).log10()
}

fn nines_label(x: f64) -> String {
    let q = 1.0 - 10f64.powf(-x);
    let pct = q * 100.0;
    if x < 0.05 {
        "0%".into()
    } else if (x - x.round()).abs() < 1e-6 {
        let digits = (x.round() as usize).saturating_sub(2);
        format!("{pct:.digits$}%")
    } else {
        format!("{pct:.1}%")
    }
}

/// Latency percentile curves at `rate` rps for one scenario, one line per peer. Returns false if
/// there was nothing to plot.
pub fn latency_curves(
    r: &Results,
    scenario: Scenario,
    rate: u64,
    path: &Path,
    text: bool,
) -> Result<bool> {
    let mut series: Vec<(PeerKind, Vec<(f64, f64)>)> = Vec::new();
    for &p in &r.peers {
        let Some(load) = r
            .cell(p, scenario)
            .and_then(|c| c.at_rate(rate))
            .filter(|run| run.error.is_none())
            .and_then(|run| run.load.as_ref())
        else {
            continue;
        };
        let pts: Vec<(f64, f64)> = load
            .percentiles
            .iter()
            .filter(|&&(q, v)| q > 0.0 && q < 1.0 && v > 0.0)
            .map(|&(q, v)| (nines(q).min(5.0), v))
            .collect();
        if pts.len() >= 2 {
            series.push((p, pts));
        }
    }
    if series.is_empty() {
        return Ok(false);
    }
    let xmax = series
        .iter()
        .flat_map(|(_, s)| s.iter().map(|p| p.0))
        .fold(3.0f64, f64::max)
        .sub(1e-6)
        .ceil();
    let ys = series.iter().flat_map(|(_, s)| s.iter().map(|p| p.1));
    let ymin = ys.clone().fold(f64::INFINITY, f64::min).max(1.0);
    let ymax = ys.fold(0.0f64, f64::max);
    let (ylo, yhi) = (
        10f64.powf(ymin.log10().floor()),
        10f64.powf(ymax.log10().ceil()).max(ymin * 10.0),
    );

    let root = BitMapBackend::new(path, (1000, 620)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut builder = ChartBuilder::on(&root);
    builder.margin(20);
    if text {
        builder
            .caption(
                format!(
                    "{}: latency percentiles at {} rps (open loop)",
                    scenario.label(),
                    thousands(rate)
                ),
                ("sans-serif", 22),
            )
            .x_label_area_size(50)
            .y_label_area_size(80);
    }
    let mut chart = builder
        .build_cartesian_2d(0f64..xmax, (ylo..yhi).log_scale())
        .map_err(err)?;
    let x_fmt = |x: &f64| nines_label(*x);
    let y_fmt = |y: &f64| {
        if *y >= 1000.0 {
            format!("{}", y.round() as u64)
        } else {
            format!("{y}")
        }
    };
    let mut mesh = chart.configure_mesh();
    if text {
        mesh.x_desc("percentile")
            .y_desc("latency (µs)")
            .x_labels(xmax as usize + 1)
            .x_label_formatter(&x_fmt)
            .y_label_formatter(&y_fmt)
            .label_style(("sans-serif", 15))
            .axis_desc_style(("sans-serif", 17));
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw().map_err(err)?;
    for (p, pts) in series {
        let c = color(p);
        let s = chart
            .draw_series(LineSeries::new(pts, c.stroke_width(3)))
            .map_err(err)?;
        if text {
            s.label(p.name()).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], c.stroke_width(3))
            });
        }
    }
    finish(&mut chart, &root, text, SeriesLabelPosition::UpperLeft)
}

/// Draws the legend (when text can be rendered) and writes the file.
fn finish<'a, CT: plotters::coord::CoordTranslate>(
    chart: &mut ChartContext<'a, BitMapBackend<'a>, CT>,
    root: &DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>,
    text: bool,
    legend: SeriesLabelPosition,
) -> Result<bool> {
    if text {
        chart
            .configure_series_labels()
            .position(legend)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 16))
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(true)
}

/// Grouped bars: saturation rps per scenario (groups) and peer (bars).
pub fn throughput_bars(r: &Results, path: &Path, text: bool) -> Result<bool> {
    let n = r.scenarios.len();
    let peers = &r.peers;
    if n == 0 || peers.is_empty() {
        return Ok(false);
    }
    let ymax = r
        .cells
        .iter()
        .filter_map(Cell::saturation)
        .map(|l| l.rps)
        .fold(0.0f64, f64::max);
    if ymax <= 0.0 {
        return Ok(false);
    }
    let ytop = ymax * 1.15;
    let root = BitMapBackend::new(path, (1100, 620)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut builder = ChartBuilder::on(&root);
    builder.margin(20);
    if text {
        builder
            .caption(
                "Saturation throughput (closed loop, requests/s)",
                ("sans-serif", 22),
            )
            .x_label_area_size(45)
            .y_label_area_size(80);
    }
    let mut chart = builder
        .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0f64..ytop)
        .map_err(err)?;
    let labels: Vec<String> = r.scenarios.iter().map(Scenario::label).collect();
    let x_fmt = |x: &f64| {
        let i = x.round();
        if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < labels.len() {
            labels[i as usize].clone()
        } else {
            String::new()
        }
    };
    let y_fmt = |y: &f64| format!("{}k", (y / 1000.0).round() as u64);
    let mut mesh = chart.configure_mesh();
    mesh.disable_x_mesh();
    if text {
        mesh.x_labels(n)
            .x_label_formatter(&x_fmt)
            .y_label_formatter(&y_fmt)
            .y_desc("requests/s")
            .label_style(("sans-serif", 15))
            .axis_desc_style(("sans-serif", 17));
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw().map_err(err)?;
    let group = 0.8;
    let w = group / peers.len() as f64;
    for (j, &p) in peers.iter().enumerate() {
        let c = color(p);
        let mut bars = Vec::new();
        let mut values = Vec::new();
        for (i, &sc) in r.scenarios.iter().enumerate() {
            let Some(v) = r.cell(p, sc).and_then(Cell::saturation).map(|l| l.rps) else {
                continue;
            };
            let x0 = i as f64 - group / 2.0 + j as f64 * w;
            bars.push(Rectangle::new(
                [(x0 + w * 0.06, 0.0), (x0 + w * 0.94, v)],
                c.filled(),
            ));
            values.push((x0 + w / 2.0, v));
        }
        let s = chart.draw_series(bars).map_err(err)?;
        if text {
            s.label(p.name())
                .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], c.filled()));
            chart
                .draw_series(values.into_iter().map(|(x, v)| {
                    Text::new(
                        format!("{:.1}k", v / 1000.0),
                        (x, v + ytop * 0.01),
                        ("sans-serif", 12).into_font().color(&BLACK).pos(
                            plotters::style::text_anchor::Pos::new(
                                plotters::style::text_anchor::HPos::Center,
                                plotters::style::text_anchor::VPos::Bottom,
                            ),
                        ),
                    )
                }))
                .map_err(err)?;
        }
    }
    finish(&mut chart, &root, text, SeriesLabelPosition::UpperRight)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nines_axis() {
        assert!((nines(0.99) - 2.0).abs() < 1e-9);
        assert_eq!(nines_label(2.0), "99%");
        assert_eq!(nines_label(3.0), "99.9%");
        assert_eq!(nines_label(1.0), "90%");
    }
}
