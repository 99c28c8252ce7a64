"""Evaluation helpers: answer extraction and scoring (GSM8K-style)."""
