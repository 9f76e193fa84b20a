//! The one SQL interface the store's queries are written against, so that each query is written
//! once for both databases: SQLite (one file, the default) and PostgreSQL (several hub replicas).
//! Queries use SQLite's numbered placeholders (`?1`); the PostgreSQL side turns them into `$1`.
//! Parameters and cells are the four kinds the schema uses: 64-bit integers, text, bytes, NULL.

use crate::Error;

/// A query parameter.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Value<'a> {
    Int(i64),
    Text(&'a str),
    /// A text column's NULL (PostgreSQL types every parameter, NULLs too).
    NullText,
    Blob(&'a [u8]),
}

impl<'a> From<&'a str> for Value<'a> {
    fn from(s: &'a str) -> Self {
        Value::Text(s)
    }
}

impl<'a> From<&'a String> for Value<'a> {
    fn from(s: &'a String) -> Self {
        Value::Text(s)
    }
}

impl From<i64> for Value<'_> {
    fn from(i: i64) -> Self {
        Value::Int(i)
    }
}

impl<'a> From<&'a [u8; 32]> for Value<'a> {
    fn from(b: &'a [u8; 32]) -> Self {
        Value::Blob(b)
    }
}

impl<'a> From<Option<&'a str>> for Value<'a> {
    fn from(s: Option<&'a str>) -> Self {
        s.map_or(Value::NullText, Value::Text)
    }
}

/// One cell of a result row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Cell {
    Null,
    Int(i64),
    Text(String),
    Blob(Vec<u8>),
}

/// One result row.
#[derive(Clone, Debug)]
pub(crate) struct Row(pub(crate) Vec<Cell>);

impl Row {
    fn cell(&self, i: usize) -> Result<&Cell, Error> {
        self.0
            .get(i)
            .ok_or_else(|| Error::Db(format!("a row has no column {i}")))
    }

    pub(crate) fn int(&self, i: usize) -> Result<i64, Error> {
        self.opt_int(i)?
            .ok_or_else(|| Error::Db(format!("column {i} is NULL")))
    }

    pub(crate) fn opt_int(&self, i: usize) -> Result<Option<i64>, Error> {
        match self.cell(i)? {
            Cell::Int(v) => Ok(Some(*v)),
            Cell::Null => Ok(None),
            other => Err(Error::Db(format!("column {i}: {other:?} is no integer"))),
        }
    }

    pub(crate) fn text(&self, i: usize) -> Result<String, Error> {
        self.opt_text(i)?
            .ok_or_else(|| Error::Db(format!("column {i} is NULL")))
    }

    pub(crate) fn opt_text(&self, i: usize) -> Result<Option<String>, Error> {
        match self.cell(i)? {
            Cell::Text(v) => Ok(Some(v.clone())),
            Cell::Null => Ok(None),
            other => Err(Error::Db(format!("column {i}: {other:?} is no text"))),
        }
    }
}

/// A connection or a transaction of either database.
pub(crate) trait Sql {
    /// Runs a statement; returns how many rows it changed.
    fn exec(&mut self, sql: &str, params: &[Value<'_>]) -> Result<u64, Error>;
    /// Runs a query; returns its rows.
    fn rows(&mut self, sql: &str, params: &[Value<'_>]) -> Result<Vec<Row>, Error>;

    /// The first row of a query, if any.
    fn row(&mut self, sql: &str, params: &[Value<'_>]) -> Result<Option<Row>, Error> {
        Ok(self.rows(sql, params)?.into_iter().next())
    }

    /// Whether a query returns a row.
    fn exists(&mut self, sql: &str, params: &[Value<'_>]) -> Result<bool, Error> {
        Ok(!self.rows(sql, params)?.is_empty())
    }
}

impl rusqlite::ToSql for Value<'_> {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        use rusqlite::types::{ToSqlOutput, ValueRef};
        Ok(ToSqlOutput::Borrowed(match *self {
            Value::Int(i) => ValueRef::Integer(i),
            Value::NullText => ValueRef::Null,
            Value::Text(s) => ValueRef::Text(s.as_bytes()),
            Value::Blob(b) => ValueRef::Blob(b),
        }))
    }
}

fn sqlite_err(e: rusqlite::Error) -> Error {
    Error::Db(e.to_string())
}

/// A SQLite connection or transaction (a transaction derefs to its connection).
pub(crate) struct Sqlite<'a>(pub(crate) &'a rusqlite::Connection);

impl Sql for Sqlite<'_> {
    fn exec(&mut self, sql: &str, params: &[Value<'_>]) -> Result<u64, Error> {
        let n = self
            .0
            .prepare_cached(sql)
            .and_then(|mut s| s.execute(rusqlite::params_from_iter(params)))
            .map_err(sqlite_err)?;
        Ok(n as u64)
    }

    fn rows(&mut self, sql: &str, params: &[Value<'_>]) -> Result<Vec<Row>, Error> {
        use rusqlite::types::ValueRef;
        let mut stmt = self.0.prepare_cached(sql).map_err(sqlite_err)?;
        let columns = stmt.column_count();
        let mut rows = stmt
            .query(rusqlite::params_from_iter(params))
            .map_err(sqlite_err)?;
        let mut out = Vec::new();
        while let Some(r) = rows.next().map_err(sqlite_err)? {
            let mut cells = Vec::with_capacity(columns);
            for i in 0..columns {
                cells.push(match r.get_ref(i).map_err(sqlite_err)? {
                    ValueRef::Null => Cell::Null,
                    ValueRef::Integer(v) => Cell::Int(v),
                    ValueRef::Text(t) => Cell::Text(
                        String::from_utf8(t.to_vec())
                            .map_err(|e| Error::Db(format!("column {i}: {e}")))?,
                    ),
                    ValueRef::Blob(b) => Cell::Blob(b.to_vec()),
                    ValueRef::Real(f) => {
                        return Err(Error::Db(format!("column {i}: unexpected real {f}")));
                    }
                });
            }
            out.push(Row(cells));
        }
        Ok(out)
    }
}

/// `?N` placeholders as PostgreSQL's `$N` (the store's SQL has no `?` anywhere else).
pub(crate) fn dollar_placeholders(sql: &str) -> String {
    sql.replace('?', "$")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn placeholders_and_cells() {
        assert_eq!(
            dollar_placeholders("SELECT a FROM t WHERE b = ?1 AND c = ?12"),
            "SELECT a FROM t WHERE b = $1 AND c = $12"
        );
        let conn = rusqlite::Connection::open_in_memory().unwrap();
        let mut c = Sqlite(&conn);
        c.exec("CREATE TABLE t (i INTEGER, s TEXT, b BLOB)", &[])
            .unwrap();
        let n = c
            .exec(
                "INSERT INTO t VALUES (?1, ?2, ?3), (?4, ?5, ?3)",
                &[
                    Value::Int(7),
                    Value::Text("x"),
                    Value::Blob(b"\0"),
                    Value::Int(1),
                    Value::NullText,
                ],
            )
            .unwrap();
        assert_eq!(n, 2);
        let rows = c.rows("SELECT i, s, b FROM t ORDER BY i", &[]).unwrap();
        assert_eq!(rows[0].opt_int(0).unwrap(), Some(1));
        assert_eq!(rows[0].opt_text(1).unwrap(), None);
        assert!(rows[0].text(1).is_err(), "a NULL read as text");
        assert_eq!(rows[1].int(0).unwrap(), 7);
        assert_eq!(rows[1].text(1).unwrap(), "x");
        assert!(rows[1].text(0).is_err(), "an integer read as text");
        assert!(rows[1].int(5).is_err());
        assert!(
            c.exists("SELECT 1 FROM t WHERE i = ?1", &[7.into()])
                .unwrap()
        );
    }
}
