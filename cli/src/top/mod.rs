//! `rgpu top`: a live view of the pool. [`model`] turns listings into
//! rows; this file draws them with ratatui (on crossterm) and reads keys:
//! `q`/Esc/Ctrl-C quit, `s` sorts servers, `l` sorts leases, `r`
//! refreshes now. With stdout not a terminal it prints one plain snapshot
//! (two listings an interval apart, so rates are shown) and exits.

pub mod model;

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use anyhow::Result;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Borders, Cell, Paragraph, Row, Table};
use ratatui::Frame;
use rgpu_broker_client::BrokerClient;

use model::{bar, link_cell, per_second, percent, LeaseSort, Listing, Model, ServerSort};

/// Runs the view until the user quits; the exit code.
pub fn run(client: &BrokerClient, interval: Duration) -> Result<i32> {
    if !std::io::stdout().is_terminal() {
        let first = Listing::fetch(client)?;
        std::thread::sleep(interval);
        let second = Listing::fetch(client)?;
        print!("{}", model::plain(&Model::new(&second, Some(&first), ServerSort::Name, LeaseSort::Tenant)));
        return Ok(0);
    }
    let mut terminal = ratatui::init();
    let r = live(client, interval, &mut terminal);
    ratatui::restore();
    r
}

fn live(client: &BrokerClient, interval: Duration, terminal: &mut ratatui::DefaultTerminal) -> Result<i32> {
    let (mut server_sort, mut lease_sort) = (ServerSort::Name, LeaseSort::Tenant);
    let mut before: Option<Listing> = None;
    let mut now = Listing::fetch(client)?;
    let mut error: Option<String> = None;
    let mut next = Instant::now() + interval;
    loop {
        let m = Model::new(&now, before.as_ref(), server_sort, lease_sort);
        terminal.draw(|f| draw(f, &m, error.as_deref()))?;
        let wait = next.saturating_duration_since(Instant::now());
        let mut refresh = wait.is_zero();
        if !refresh && event::poll(wait)? {
            if let Event::Key(k) = event::read()? {
                if k.kind == KeyEventKind::Press {
                    match k.code {
                        KeyCode::Char('q') | KeyCode::Esc => return Ok(0),
                        KeyCode::Char('c') if k.modifiers.contains(KeyModifiers::CONTROL) => return Ok(0),
                        KeyCode::Char('s') => server_sort = server_sort.next(),
                        KeyCode::Char('l') => lease_sort = lease_sort.next(),
                        KeyCode::Char('r') => refresh = true,
                        _ => {}
                    }
                }
            }
        }
        if refresh || Instant::now() >= next {
            // A broker that is away is shown, not fatal: the view keeps its
            // last listing and tries again at the next tick.
            match Listing::fetch(client) {
                Ok(l) => {
                    before = Some(std::mem::replace(&mut now, l));
                    error = None;
                }
                Err(e) => error = Some(e.to_string()),
            }
            next = Instant::now() + interval;
        }
    }
}

fn draw(f: &mut Frame, m: &Model, error: Option<&str>) {
    let servers_h = (m.servers.len() as u16).saturating_add(3).min(f.area().height / 2);
    let [head, servers, leases, keys] =
        Layout::vertical([Constraint::Length(1), Constraint::Length(servers_h), Constraint::Min(3), Constraint::Length(1)])
            .areas(f.area());
    let bold = Style::default().add_modifier(Modifier::BOLD);
    f.render_widget(Paragraph::new(Line::styled(m.header(), bold)), head);

    let rows = m.servers.iter().map(|s| {
        let leased = (s.gpus - s.gpus_free.min(s.gpus)) as f64 / s.gpus.max(1) as f64;
        let mem = s.memory_used as f64 / s.memory.max(1) as f64;
        Row::new(vec![
            Cell::from(s.id.clone()),
            Cell::from(s.state.clone()),
            Cell::from(format!("{}/{}", s.gpus_free, s.gpus)),
            Cell::from(format!("{} {}", bar(leased, 10), s.gpus - s.gpus_free.min(s.gpus))),
            Cell::from(format!("{} {:.0}%", bar(mem, 10), mem * 100.0)),
            Cell::from(format!("{} {}", bar(s.busy.unwrap_or(0.0), 10), percent(s.busy))),
            Cell::from(s.leases.to_string()),
            Cell::from(per_second(s.rate_in)),
            Cell::from(per_second(s.rate_out)),
            Cell::from(link_cell(s.link, 10)),
        ])
    });
    let t = Table::new(
        rows,
        [
            Constraint::Length(22),
            Constraint::Length(11),
            Constraint::Length(9),
            Constraint::Length(15),
            Constraint::Length(17),
            Constraint::Length(17),
            Constraint::Length(6),
            Constraint::Length(12),
            Constraint::Length(12),
            Constraint::Length(17),
        ],
    )
    .header(Row::new(["SERVER", "STATE", "GPUS FREE", "GPUS LEASED", "MEMORY", "BUSY", "LEASES", "IN", "OUT", "LINK"]).style(bold))
    .block(Block::default().borders(Borders::TOP).title(format!(" servers (sorted by {}) ", m.server_sort.name())));
    f.render_widget(t, servers);

    let rows = m.leases.iter().map(|l| {
        let u = crate::pool::UseCells::of(l.usage.as_ref());
        Row::new(vec![
            l.id.clone(),
            l.tenant.clone(),
            l.gpus.to_string(),
            l.share.clone(),
            l.state.clone(),
            u.device,
            u.kernels,
            per_second(l.rate),
            l.expires.clone(),
            l.servers.clone(),
        ])
    });
    let t = Table::new(
        rows,
        [
            Constraint::Length(16),
            Constraint::Length(10),
            Constraint::Length(4),
            Constraint::Length(8),
            Constraint::Length(7),
            Constraint::Length(10),
            Constraint::Length(8),
            Constraint::Length(12),
            Constraint::Length(10),
            Constraint::Min(10),
        ],
    )
    .header(
        Row::new(["LEASE", "TENANT", "GPUS", "SHARE", "STATE", "DEVICE", "KERNELS", "TRAFFIC", "EXPIRES", "SERVERS"]).style(bold),
    )
    .block(Block::default().borders(Borders::TOP).title(format!(" leases (sorted by {}) ", m.lease_sort.name())));
    f.render_widget(t, leases);

    let footer = match error {
        Some(e) => format!("broker: {e} (retrying)"),
        None => "q quit  s sort servers  l sort leases  r refresh".to_string(),
    };
    f.render_widget(Paragraph::new(footer), keys);
}
