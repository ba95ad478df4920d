"""kvserve.loadtest"""
