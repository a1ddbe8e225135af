//! `gpuverbs plot`: the bandwidth-vs-size and latency-vs-size plots of the docs, drawn as SVG
//! from the samples' `--json` output (one JSON object per line: `put_bw` rows carry `bytes` and
//! `bw_average` / `bw_peak`, `write_lat` rows `bytes` and `t_typical_us`, `t_avg_us`, `p99_us`,
//! ...). Each input file is one series, named by `--label` (in order) or by the file name; the
//! x axis is the message size on a log2 scale, the y axis the chosen field on a log10 scale
//! (bandwidth and latency both span decades over the sizes).

use plotters::prelude::*;
use std::path::{Path, PathBuf};

/// Why a plot could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// An input file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A line of an input file is not a JSON object.
    #[error("{path} line {line}: not JSON: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// An input file has no row with both `bytes` and the field.
    #[error("{path}: no row has both \"bytes\" and \"{field}\"")]
    NoRows {
        /// The file.
        path: PathBuf,
        /// The field asked for.
        field: String,
    },
    /// Nothing to plot, or more labels than files.
    #[error("{0}")]
    Usage(String),
    /// The SVG could not be drawn or written.
    #[error("drawing {path}: {message}")]
    Draw {
        /// The output file.
        path: PathBuf,
        /// The drawing library's message.
        message: String,
    },
}

/// What to plot.
#[derive(Clone, Debug)]
pub struct PlotSpec {
    /// The y field of each row (`bw_average`, `t_typical_us`, ...).
    pub field: String,
    /// The y axis label.
    pub y_label: String,
    /// A log10 y axis.
    pub log_y: bool,
    /// The title.
    pub title: String,
}

impl PlotSpec {
    /// Bandwidth (`bw_average`, MB/s) against size.
    pub fn bandwidth(title: &str) -> Self {
        Self {
            field: "bw_average".into(),
            y_label: "average bandwidth [MB/s]".into(),
            log_y: true,
            title: title.into(),
        }
    }

    /// Latency (`t_typical_us`, µs of half a round trip) against size.
    pub fn latency(title: &str) -> Self {
        Self {
            field: "t_typical_us".into(),
            y_label: "typical latency, half a round trip [us]".into(),
            log_y: true,
            title: title.into(),
        }
    }
}

/// One series: a name and its (bytes, y) points, sorted by size.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// The legend entry.
    pub name: String,
    /// (message size in bytes, value).
    pub points: Vec<(f64, f64)>,
}

/// The first character of a line that holds a JSON row (a JSON object).
const ROW_START: char = '{';

/// The (bytes, `field`) points of one samples `--json` output; lines that are not JSON objects
/// starting with `{` (a table printed alongside) are skipped, rows without the field too.
pub fn read_series(path: &Path, field: &str, name: String) -> Result<Series, PlotError> {
    let text = std::fs::read_to_string(path).map_err(|source| PlotError::Read {
        path: path.into(),
        source,
    })?;
    let mut points = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if !line.starts_with(ROW_START) {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|source| PlotError::Json {
                path: path.into(),
                line: i + 1,
                source,
            })?;
        if let (Some(x), Some(y)) = (
            v.get("bytes").and_then(|b| b.as_f64()),
            v.get(field).and_then(|b| b.as_f64()),
        ) {
            if x > 0.0 && y.is_finite() {
                points.push((x, y));
            }
        }
    }
    if points.is_empty() {
        return Err(PlotError::NoRows {
            path: path.into(),
            field: field.into(),
        });
    }
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    Ok(Series { name, points })
}

/// Reads every input (`labels` name the first ones; the others are named by their file stem)
/// and draws them into `out`.
pub fn plot_files(
    spec: &PlotSpec,
    inputs: &[PathBuf],
    labels: &[String],
    out: &Path,
) -> Result<Vec<Series>, PlotError> {
    if inputs.is_empty() {
        return Err(PlotError::Usage("no input file".into()));
    }
    if labels.len() > inputs.len() {
        return Err(PlotError::Usage(format!(
            "{} labels for {} files",
            labels.len(),
            inputs.len()
        )));
    }
    let series = inputs
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let name = labels.get(i).cloned().unwrap_or_else(|| {
                p.file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_else(|| p.display().to_string())
            });
            read_series(p, &spec.field, name)
        })
        .collect::<Result<Vec<_>, _>>()?;
    draw(spec, &series, out)?;
    Ok(series)
}

/// Draws `series` as an SVG of 900 × 540 into `out`.
pub fn draw(spec: &PlotSpec, series: &[Series], out: &Path) -> Result<(), PlotError> {
    let fail = |e: &dyn std::fmt::Display| PlotError::Draw {
        path: out.into(),
        message: e.to_string(),
    };
    let all = series.iter().flat_map(|s| s.points.iter());
    let (x0, x1) = all
        .clone()
        .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (y0, y1) = all.fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
    if x0 > x1 {
        return Err(PlotError::Usage("no points".into()));
    }
    // log2 of the size on x; y linear from 0, or log10 over the decades it spans
    let (lx0, lx1) = (
        x0.log2().floor(),
        x1.log2().ceil().max(x0.log2().floor() + 1.0),
    );
    let root = SVGBackend::new(out, (900, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let mut b = ChartBuilder::on(&root);
    b.caption(&spec.title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72);
    let size_label = |v: &f64| {
        let n = 2f64.powf(*v);
        match n {
            n if n >= (1u64 << 30) as f64 => format!("{}G", n / (1u64 << 30) as f64),
            n if n >= (1 << 20) as f64 => format!("{}M", n / (1 << 20) as f64),
            n if n >= 1024.0 => format!("{}K", n / 1024.0),
            n => format!("{n}"),
        }
    };
    let colors = [&BLUE, &RED, &GREEN, &MAGENTA, &CYAN, &BLACK];
    // y: log10 over the decades the values span (labels on decades only), or linear from 0
    let (yr, ty, labels): (std::ops::Range<f64>, fn(f64) -> f64, usize) = if spec.log_y {
        let lo = y0.max(1e-3).log10().floor();
        let hi = y1.max(1e-3).log10().ceil().max(lo + 1.0);
        (lo..hi, |y| y.max(1e-3).log10(), (hi - lo) as usize + 1)
    } else {
        (0.0..if y1 > 0.0 { y1 * 1.1 } else { 1.0 }, |y| y, 10)
    };
    let log_y = spec.log_y;
    let y_label = move |v: &f64| {
        if !log_y {
            format!("{v}")
        } else if (v - v.round()).abs() > 1e-6 {
            String::new()
        } else if *v < 0.0 {
            format!("{}", 10f64.powi(v.round() as i32))
        } else {
            format!("{:.0}", 10f64.powi(v.round() as i32))
        }
    };
    let mut c = b.build_cartesian_2d(lx0..lx1, yr).map_err(|e| fail(&e))?;
    c.configure_mesh()
        .x_desc("message size [bytes]")
        .y_desc(&spec.y_label)
        .x_label_formatter(&size_label)
        .y_labels(labels)
        .y_label_formatter(&y_label)
        .draw()
        .map_err(|e| fail(&e))?;
    for (i, s) in series.iter().enumerate() {
        let col = colors[i % colors.len()];
        let pts = s.points.iter().map(|&(x, y)| (x.log2(), ty(y)));
        c.draw_series(LineSeries::new(pts, col.stroke_width(2)))
            .map_err(|e| fail(&e))?
            .label(&s.name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], col));
    }
    c.configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()
        .map_err(|e| fail(&e))?;
    root.present().map_err(|e| fail(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("gpuverbs-plot-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d.join(name)
    }

    #[test]
    fn rows_become_sorted_points_and_tables_are_skipped() {
        let p = tmp("bw.json");
        std::fs::write(
            &p,
            " #bytes  BW\n{\"bytes\":4096,\"bw_average\":300.5}\n{\"bytes\":2,\"bw_average\":0.1}\n\
             {\"bytes\":8,\"other\":1}\n",
        )
        .unwrap();
        let s = read_series(&p, "bw_average", "x".into()).unwrap();
        assert_eq!(s.points, vec![(2.0, 0.1), (4096.0, 300.5)]);
        assert!(matches!(
            read_series(&p, "t_typical_us", "x".into()),
            Err(PlotError::NoRows { .. })
        ));
        std::fs::write(&p, "{\"bytes\": 2,\n").unwrap();
        assert!(matches!(
            read_series(&p, "bw_average", "x".into()),
            Err(PlotError::Json { line: 1, .. })
        ));
    }

    #[test]
    fn an_svg_with_every_series_is_written() {
        let (a, b, out) = (tmp("soft.json"), tmp("mlx5.json"), tmp("bw.svg"));
        let rows = |k: f64| {
            (1..=12)
                .map(|i| {
                    format!(
                        "{{\"bytes\":{},\"bw_average\":{}}}\n",
                        1u64 << i,
                        k * i as f64
                    )
                })
                .collect::<String>()
        };
        std::fs::write(&a, rows(10.0)).unwrap();
        std::fs::write(&b, rows(20.0)).unwrap();
        let spec = PlotSpec::bandwidth("put_bw");
        let s = plot_files(&spec, &[a, b], &["soft NIC".into()], &out).unwrap();
        assert_eq!(
            (s[0].name.as_str(), s[1].name.as_str()),
            ("soft NIC", "mlx5")
        );
        let svg = std::fs::read_to_string(&out).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("soft NIC") && svg.contains("mlx5"));
        assert!(svg.contains("put_bw") && svg.matches("<polyline").count() >= 2);
        assert!(matches!(
            plot_files(&spec, &[], &[], &out),
            Err(PlotError::Usage(_))
        ));
    }
}
