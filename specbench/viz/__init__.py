"""Plotly figures and HTML reports over prediction and record DataFrames."""
