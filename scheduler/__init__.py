"""kvserve.scheduler"""
